"""The tools on top of the door (autopar/api.py): the command line and what it runs (tune,
microbench, worker, launcher, verify, demo, planning, model_source, zoo_check) and the
reports (report, plan_dump, plan_view, html_report, gantt). Nothing below imports them."""
