"""ZeRO's sharded data parallelism as plain modules (no Lightning needed).

* :mod:`lightning_par.zero.units` - parameters laid end to end in flat units, one equal
  shard per rank;
* :mod:`lightning_par.zero.optimizer` - the user's element-wise optimizer stepping this
  rank's shards;
* :mod:`lightning_par.zero.grads` - gradients reduce-scattered unit by unit during backward
  (stages 2-3);
* :mod:`lightning_par.zero.gather` - stage 3's gather-before-use and free-after of each
  layer's units;
* :mod:`lightning_par.zero.cost` - bytes held per rank and bytes sent per step, stage by
  stage;
* :mod:`lightning_par.zero.sharded_checkpoint` - checkpoints each rank writes its shards of.

The strategy that puts them together is :class:`lightning_par.strategies.zero.ZeroStrategy`.
"""
