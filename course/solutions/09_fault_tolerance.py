def my_stands_in_for(first_world, survivors, me):
    """The shards of the lost ranks that survivor ``me`` trains beside its own: the lost
    ranks (those of 0 .. first_world - 1 not in ``survivors``), in increasing order, handed
    round robin over ``survivors`` in their order."""
    lost = [r for r in range(first_world) if r not in survivors]
    return [r for i, r in enumerate(lost) if survivors[i % len(survivors)] == me]


def my_loss_scale(first_world, survivors):
    """What each survivor multiplies its summed loss by, so that the allreduce's average over
    the survivors is one process's gradient on the whole batch."""
    # the allreduce divides the survivors' sum by len(survivors); one process divides the
    # sum over every shard by first_world
    return len(survivors) / first_world
