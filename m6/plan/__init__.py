"""Layout planner: per-rank memory and step time of every layout m6 can run, searched for the
fastest that fits (``python -m m6.plan CONFIG --gpus N ...``). Imports config, model, moe,
memory and parallel; never data or train."""
