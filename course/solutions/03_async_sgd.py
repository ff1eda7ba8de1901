def staleness_aware_lr(lr, staleness):
    """The learning rate of an update `staleness` updates stale (Zhang et al. 2016):
    lr / staleness, and the full lr for a fresh or once-stale update."""
    return lr / max(1, staleness)


def dc_gradient(grad, weights, read, lam):
    """DC-ASGD's compensated gradient, element by element:
    grad + lam * grad * grad * (weights - read)."""
    return grad + lam * grad * grad * (weights - read)
