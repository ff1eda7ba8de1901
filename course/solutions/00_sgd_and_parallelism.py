import torch


def parallel_sgd_step(w: torch.Tensor, shards: list[torch.Tensor], lr: float, grad) -> torch.Tensor:
    """Every worker k starts from w and takes ONE SGD step on its shard (the sample indices
    shards[k]; grad(w, idx) is the mean-loss gradient, like `gradient` of section 1). Return
    the average of the workers' new weights, and leave w itself unchanged."""
    workers = [w - lr * grad(w, shard) for shard in shards]  # new tensors: w stays as it was
    return torch.stack(workers).mean(0)
