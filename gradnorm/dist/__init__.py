"""The thin distributed shell: the only part of gradnorm that touches torch.distributed.

- ``comm``     the process group (NCCL on CUDA, gloo on CPU), THE all-reduce of counts, rank-0 printing
- ``wrap``     DDP or FSDP2 around a policy; gradient clipping and checkpoint state over shards
- ``harness``  real multi-process checks: spawned gloo workers, the collective counter

Nothing outside this package imports torch.distributed, so the pure core, the simulation and the
notebooks' modules can be read (and imported) without it.
"""
