"""The thin distributed shell: the only part of gradnorm that touches torch.distributed.

- ``comm``   the process group (NCCL on CUDA, gloo on CPU), THE all-reduce of counts, the logging
             reductions, the rollout's all_gather, rank-0 printing
- ``wrap``   DDP or FSDP2 around a model; clipping over shards; parameters gathered for sampling
- ``state``  the training state by name, written and read sharded (torch.distributed.checkpoint)
- ``spawn``  W spawned gloo processes on one machine, and a counter of the collectives they issue

Nothing outside this package imports torch.distributed (tests/project/test_layers.py checks it), so the
core, the simulation and the notebooks' modules can be read and imported without it.
"""
