"""The plan of a job before anything is spent: parameter counts and FLOPs, memory per GPU for a layout, time and
cost, the recipe's timeline, and the dry run that builds the job's real shards at its world size on one CPU.

| file | what |
|---|---|
| counts.py | parameters (total, active) and FLOPs per token of a GLM46Config, from the model on the meta device |
| plan.py | memory per GPU, time and cost of a model on a layout and hardware |
| peft_memory.py | what adapters (peft=lora, peft=dora) add to the plan: their count and share, the dtypes' names |
| sizing.py | the composed job's hardware, layout and plan, read from the config |
| timeline.py | every phase of the composed recipe with its place on the token clock (`task=plan`) |
| dryrun.py | `task=dryrun`: the job at its real world size, as one rank, on torch's fake process group |
"""
