import torch


def two_stage_gpipe(comm, stage, x, y, loss_fn, chunks):
    """One GPipe step of ``chunks`` micro-batches on two ranks: rank 0's ``stage`` holds the
    first layers, rank 1's the rest and computes ``loss_fn``; afterwards the parameters' .grad
    hold the gradient of the batch-mean loss. Activations have shape (n, HIDDEN) for n samples
    (on rank 1, HIDDEN is also ``stage[0].in_features``)."""
    xs, ys = x.tensor_split(chunks), y.tensor_split(chunks)
    if comm.rank == 0:
        outputs = []
        for xi in xs:  # all forwards first
            out = stage(xi)
            comm.send(out.detach(), 1)
            outputs.append(out)
        for out in reversed(outputs):  # rank 1 sends the gradients, last micro-batch first
            out.backward(comm.recv(torch.empty_like(out), 1))
    else:
        received, loss = [], 0.0
        for xi, yi in zip(xs, ys):
            act = comm.recv(torch.empty(len(xi), stage[0].in_features), 0).requires_grad_()
            received.append(act)
            loss = loss + loss_fn(stage(act), yi) * len(xi) / len(x)  # the batch mean
        loss.backward()
        for act in reversed(received):
            comm.send(act.grad, 0)
