import copy

import pytest
import torch

from scratchlm.model.transformer import TransformerLM
from scratchlm.train.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing


def _model():
    torch.manual_seed(0)
    return TransformerLM(vocab_size=64, context_length=16, d_model=32, num_layers=3, num_heads=4, d_ff=48)


def _loss_and_grads(model, ids):
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("every", [1, 2])
def test_same_loss_and_grads_as_without(every):
    plain = _model()
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped, every=every) == (3 if every == 1 else 2)
    ids = torch.randint(0, 64, (2, 13))
    loss, grads = _loss_and_grads(plain, ids)
    loss_ckpt, grads_ckpt = _loss_and_grads(wrapped, ids)
    torch.testing.assert_close(loss_ckpt, loss)
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-6)
    assert list(wrapped.state_dict()) == list(plain.state_dict())


def test_recomputes_forward_in_backward_and_can_be_removed():
    model = _model()
    apply_activation_checkpointing(model, every=1)
    apply_activation_checkpointing(model, every=1)  # idempotent: no nested checkpoints
    calls = []
    model.layers[1].ffn.register_forward_pre_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, 64, (2, 9))
    _loss_and_grads(model, ids)
    assert len(calls) == 2  # forward + recomputation
    assert remove_activation_checkpointing(model) == 3
    calls.clear()
    _loss_and_grads(model, ids)
    assert len(calls) == 1


def test_rejects_models_without_layers():
    with pytest.raises(TypeError):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))
