"""The build floor: Plan + captured graph -> this rank's program.

It materializes only what this rank keeps under the Plan (from a model built on the meta
device: safetensors slices, a Hugging Face checkpoint directory, an autopar DCP checkpoint,
or the modules' own initialization replayed one full tensor at a time) and writes trained
weights back out (Hugging Face compatible safetensors, streamed tensor by tensor).
Imports: search, cost, passes, runtime (never api or the tools above it).
"""
