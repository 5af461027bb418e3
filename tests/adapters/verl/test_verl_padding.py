"""The adapter's device-side gather of verl's packed model outputs gives exactly the tensors verl's own
``no_padding_2_padding`` gives (bitwise, NaNs included), on micro-batches built by verl's own functions, in both of
verl's layouts: the trainer's left/right-padded prompts and responses (``left_right_2_no_padding``), and prompts and
responses packed end to end (nested, with and without ``max_response_len``). And it reads no value to the host,
where verl's function reads one per sequence and more."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from rl_guard.adapters.verl import gather_response, response_positions, token_batch

PROMPT_LENS = [3, 1, 7, 5, 2, 6, 4, 1]  # 1..P, ragged
RESPONSE_LENS = [4, 9, 1, 0, 6, 9, 2, 5]  # 0..R: an empty response and two full-width ones
P, R = max(PROMPT_LENS), max(RESPONSE_LENS)


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (``.item()``, ``bool(t)``, ``int(t)``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, (a.shape, b.shape, a.dtype, b.dtype)
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(a.isnan(), b.isnan())


def padded_batch(gen: torch.Generator) -> TensorDict:
    """A rollout batch as verl's trainer holds it: prompts left-padded to P, responses right-padded to R."""
    b = len(PROMPT_LENS)
    prompt_mask = torch.arange(P) >= P - torch.tensor(PROMPT_LENS).unsqueeze(1)
    response_mask = torch.arange(R) < torch.tensor(RESPONSE_LENS).unsqueeze(1)
    attention = torch.cat([prompt_mask, response_mask], dim=1).long()
    input_ids = torch.randint(3, 1000, (b, P + R), generator=gen) * attention

    def rng():
        return torch.randn(b, R, generator=gen) * response_mask

    return TensorDict(
        {
            "prompts": input_ids[:, :P],
            "responses": input_ids[:, P:],
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "response_mask": response_mask.long(),
            "old_log_probs": rng(),
            "advantages": rng(),
            "token_level_scores": rng(),
            "ref_log_prob": rng(),
        },
        batch_size=[b],
    )


def nested_batch(gen: torch.Generator, max_response_len: int | None) -> TensorDict:
    """Prompts, responses and per-response fields packed end to end, as verl's padding-free trainer keeps them."""

    def jag(lens, fill):
        return torch.nested.as_nested_tensor([fill(n) for n in lens], layout=torch.jagged)

    def ids(n):
        return torch.randint(3, 1000, (n,), generator=gen)

    def floats(n):
        return torch.randn(n, generator=gen)

    responses = RESPONSE_LENS  # an empty one among them
    data = TensorDict(
        {
            "prompts": jag(PROMPT_LENS, ids),
            "responses": jag(responses, ids),
            "response_mask": jag(responses, lambda n: torch.ones(n, dtype=torch.long)),
            "old_log_probs": jag(responses, floats),
            "advantages": jag(responses, floats),
            "rollout_log_probs": jag(responses, floats),
        },
        batch_size=[len(PROMPT_LENS)],
    )
    if max_response_len is not None:
        tu.assign_non_tensor_data(data, "max_response_len", max_response_len)
    return data


def model_output(total: int, gen: torch.Generator, dtype=torch.float32, tail=()) -> torch.Tensor:
    """Packed per-token outputs ``[total, *tail]``, some NaN (they must come through where verl keeps them)."""
    out = torch.randn(total, *tail, generator=gen).to(dtype)
    out[torch.randint(0, total, (5,), generator=gen)] = float("nan")
    return out


def lengths(data: TensorDict) -> tuple[list[int], list[int]]:
    if data["prompts"].is_nested:
        return data["prompts"].offsets().diff().tolist(), data["responses"].offsets().diff().tolist()
    return data["attention_mask"][:, :P].sum(1).tolist(), data["attention_mask"][:, P:].sum(1).tolist()


def micro_batches(data: TensorDict) -> list[TensorDict]:
    """verl's split of a batch into micro-batches (rebuilds the nested tensors), as its engine does."""
    return [*tu.chunk_tensordict(data, 2), tu.index_select_tensor_dict(data, torch.tensor([6, 0, 3, 5, 1]))]


@pytest.mark.parametrize("dtype,tail", [(torch.float32, ()), (torch.bfloat16, ()), (torch.float32, (3,))])
def test_gather_equals_verl_on_the_trainers_padded_layout(dtype, tail):
    gen = torch.Generator().manual_seed(0)
    data = left_right_2_no_padding(padded_batch(gen))
    assert data["input_ids"].is_nested and not data["prompts"].is_nested
    for micro in micro_batches(data):
        prompt_lens, response_lens = lengths(micro)
        total = sum(prompt_lens) + sum(response_lens)
        packed = model_output(total, gen, dtype, tail)
        nested = torch.nested.nested_tensor_from_jagged(packed, offsets=micro["input_ids"].offsets())
        index, valid = response_positions(micro)
        for output in (packed, nested):
            same(gather_response(output, index, valid), no_padding_2_padding(output, micro))
        assert valid.sum(1).tolist() == response_lens


@pytest.mark.parametrize("max_response_len", [None, R + 3])
def test_gather_equals_verl_on_the_nested_layout(max_response_len):
    gen = torch.Generator().manual_seed(1)
    for micro in micro_batches(nested_batch(gen, max_response_len)):
        prompt_lens, response_lens = lengths(micro)
        packed = model_output(sum(prompt_lens) + sum(response_lens), gen)
        width = torch.nested.to_padded_tensor(micro["response_mask"], 0.0).shape[-1]
        index, valid = response_positions(micro, width=width)
        same(gather_response(packed, index, valid), no_padding_2_padding(packed, micro))
        index, valid = response_positions(micro)  # without the padded fields' width: verl's own figure
        same(gather_response(packed, index, valid), no_padding_2_padding(packed, micro))


@pytest.mark.parametrize("layout", ["padded", "nested"])
def test_token_batch_holds_what_ppo_loss_computes_on_without_host_reads(layout):
    gen = torch.Generator().manual_seed(2)
    data = left_right_2_no_padding(padded_batch(gen)) if layout == "padded" else nested_batch(gen, None)
    micro = micro_batches(data)[-1]
    prompt_lens, response_lens = lengths(micro)
    total = sum(prompt_lens) + sum(response_lens)
    output = {"log_probs": model_output(total, gen), "entropy": model_output(total, gen, torch.bfloat16)}
    fields = ["response_mask", "old_log_probs", "advantages"] + [
        k for k in ("ref_log_prob", "rollout_log_probs", "token_level_scores") if k in micro
    ]
    expected = micro.select(*fields).to_padded_tensor()  # as ppo_loss pads them
    log_prob, entropy = (no_padding_2_padding(output[k], micro) for k in ("log_probs", "entropy"))
    with HostReads() as reads:
        batch = token_batch(output, micro)
    assert reads.count == 0
    same(batch.logprobs, log_prob)
    same(batch.entropy, entropy.float())
    same(batch.mask, expected["response_mask"].bool())
    old = expected["rollout_log_probs"] if layout == "nested" else expected["old_log_probs"]
    same(batch.old_logprobs, old)
    same(batch.advantages, expected["advantages"])
    with HostReads() as reads:  # the counter sees verl's reads: one per sequence and more
        no_padding_2_padding(output["log_probs"], micro)
    assert reads.count > len(response_lens)
