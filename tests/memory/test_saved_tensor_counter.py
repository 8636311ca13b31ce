"""The activation count: bytes saved for backward by graphs alive at once, each storage once."""

import torch

from pl_lowprec.memory.activations import count_saved_tensors
from pl_lowprec.transforms.offloading import OffloadActivations


def test_a_graph_that_dies_before_backward_does_not_hide_a_later_saved_tensor():
    """peft's DoRA builds ``lora_B(lora_A(eye))`` and keeps only its detached result: that graph's tensors are freed
    at once, and a later storage may take a freed one's address. Counted by address for the whole forward, the
    later tensor read as already counted (the estimate of QLoRA with DoRA came out ~27% under the measured)."""
    x = torch.ones(250, requires_grad=True)
    with count_saved_tensors() as counter:
        (x * 2).sin().detach()  # saves a 1,000-byte tensor, freed with its graph on this line
        kept = (x.repeat(16) * 3).sin()  # saves 16,000 bytes, held until backward
        assert counter.nbytes == 16_000
        kept.sum().backward()
    assert counter.nbytes == 16_000  # the most alive at once, read after backward as MemoryTracker does


def test_a_saved_sparse_tensor_is_left_out_not_a_crash():
    """A sparse tensor has no storage to follow (``untyped_storage()`` raises): it is not counted, as before the
    counter followed saved tensors' lives."""
    sparse = torch.eye(4).to_sparse()
    dense = torch.ones(4, 3, requires_grad=True)
    with count_saved_tensors() as counter:
        out = torch.sparse.mm(sparse, dense)  # saves the sparse matrix for dense's gradient
    out.sum().backward()
    assert counter.nbytes == 0
    assert torch.equal(dense.grad, torch.ones(4, 3))


def test_under_offloading_a_graph_that_dies_before_backward_does_not_count_either():
    """Offloading's hooks sit inside the counter's and report each saved tensor; what stays on the device counted
    until backward and kept its address, as the counter's own hook did before (17,000 here, not 16,000)."""
    x = torch.ones(250, requires_grad=True)
    with count_saved_tensors() as counter, OffloadActivations(torch.device("cpu"), min_bytes=10**9):
        (x * 2).sin().detach()
        kept = (x.repeat(16) * 3).sin()
        assert counter.nbytes == 16_000
    kept.sum().backward()
    assert counter.nbytes == 16_000 and counter.offloaded_nbytes == 0
    torch.testing.assert_close(x.grad, 48 * torch.cos(torch.full((250,), 3.0)))  # unpacked right


def test_a_moved_tensor_counts_on_the_host_while_its_copy_lives():
    """Host copies count as the device tensors do: while the graph that saved them lives. Counted per move, the
    copies of a graph already freed added up (32,000 here)."""
    x = torch.ones(250, requires_grad=True)
    with count_saved_tensors() as counter, OffloadActivations(torch.device("cpu"), min_bytes=1):
        (x.repeat(16) * 3).sin().sum().backward()  # 16,000 bytes move to the host and are freed with the graph
        kept = (x.repeat(16) * 5).sin()  # 16,000 bytes more, held until backward
        assert counter.offloaded_nbytes == 16_000 and counter.nbytes == 0
    kept.sum().backward()
    assert counter.offloaded_nbytes == 16_000


def _reentrant_blocks(x: torch.Tensor, blocks: int = 4) -> torch.Tensor:
    for _ in range(blocks):
        x = torch.utils.checkpoint.checkpoint(lambda t: (t * 3).sin().cos(), x, use_reentrant=True)
    return x


def test_saves_made_during_backward_are_not_counted():
    """Reentrant checkpointing keeps only each block's input in the forward, and recomputes the block in backward
    without hooks of its own: those saves live for one block's backward and are not the forward's figure. The
    estimate's manual-optimization step runs ``manual_backward`` inside its count, and ``MemoryTracker`` closes its
    counter after backward: both read the forward's."""
    x = torch.ones(1000, requires_grad=True)
    with count_saved_tensors() as forward_only:
        out = _reentrant_blocks(x)
    out.sum().backward()
    with count_saved_tensors() as with_backward:
        _reentrant_blocks(x).sum().backward()
    assert with_backward.nbytes == forward_only.nbytes
