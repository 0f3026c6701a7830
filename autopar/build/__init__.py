"""The build floor: Plan + captured graph -> this rank's program.

It completes a plan for its mesh and graph (plan_complete.py: tp sharding, experts, context
exchange, fusions), runs the rank's passes, chooses recompute for a memory budget
(recompute_plan.py), predicts the step (predict.py), cuts pipeline stages (pipeline.py) and
builds the one per-rank `runtime.program.Program` (program.py). It materializes only what this
rank keeps under the Plan (from a model built on the meta device: safetensors slices, a Hugging
Face checkpoint directory, an autopar DCP checkpoint, or the modules' own initialization
replayed one full tensor at a time) and writes trained weights back out (Hugging Face
compatible safetensors, streamed tensor by tensor).
Imports: search, cost, passes, runtime (never api or the tools above it).
"""
