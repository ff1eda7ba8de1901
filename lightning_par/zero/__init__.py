"""ZeRO's sharded data parallelism as plain modules (no Lightning needed).

* :mod:`.units` - parameters laid end to end in flat units, one equal shard per rank;
* :mod:`.optimizer` - the user's element-wise optimizer stepping this rank's shards;
* :mod:`.grads` - gradients reduce-scattered unit by unit during backward (stages 2-3);
* :mod:`.gather` - stage 3's gather-before-use and free-after of each layer's units;
* :mod:`.cost` - bytes held per rank and bytes sent per step, stage by stage.

The strategy that puts them together is :class:`lightning_par.strategies.zero.ZeroStrategy`.
"""
