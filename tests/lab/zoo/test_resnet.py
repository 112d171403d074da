"""The zoo's residual CNN: each block keeps its input's shape (the sum needs it), and its pipelined
gradients, batch norm and all, are the same bits whatever K cuts it."""
import torch

from engine import GPipe
from lab.zoo import resnet


def test_a_residual_block_keeps_the_shape_its_sum_needs():
    block = resnet.Residual(8)
    x = torch.randn(2, 8, 16, 16)
    assert block(x).shape == x.shape and (block(x) >= 0).all()


def test_its_gradients_do_not_depend_on_the_cut():
    x, y = resnet.batch(16, 8, seed=3)
    grads = {}
    for stages in (1, 2, 4):  # one thread per stage at every K: a convolution's sums follow its threads
        pipe = GPipe(resnet.build(4, 8, seed=1), stages, chunks=4, checkpoint="except_last", threads_per_stage=1)
        pipe.step(x, y, resnet.loss)
        grads[stages] = [p.grad for p in pipe.parameters()]
        pipe.close()
    assert all(torch.equal(a, b) for k in (2, 4) for a, b in zip(grads[1], grads[k]))
