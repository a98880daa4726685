"""Data parallelism: windows over named mesh axes.

``distributed`` (per-replica windows inside ``shard_map`` reduced once),
``replicas`` (stacked per-replica windows carried across jitted steps),
``spmd_layout`` (meshes, partition specs and FSDP layouts of the params) and
``local_grads`` (gradients that autodiff has not yet reduced); ``placed``
(the one placement check) and ``functional`` (the public functional API,
dispatching on the window's placement).
"""
