"""The roofline model against the paper's testbed (DESIGN.md §2), and its structure.

Pinned figures (arXiv 2609.27085, GPT-OSS-120B), each with its tolerance:

* decode batch 8 -> 20 (x2.5, 1K-token contexts): throughput x1.74 +- 0.10, compute activity
  x1.44 +- 0.10 (compute activity must not track throughput);
* contexts 1K -> 82K per request at batch 8: memory traffic (HBM busy share of the step) x2.0
  +- 0.3, throughput -10% +- 5 points.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossflow_ctl.domain.capacity import (
    MODEL_PRESETS,
    NODE_PRESETS,
    ModelSpec,
    NodeProfile,
    StepShape,
    kernel_time_s,
    roofline,
    step_cost,
    step_time_s,
)

GPT_OSS = MODEL_PRESETS["gpt-oss-120b"]


def cost(node: NodeProfile, batch: int, context_per_request: int):  # type: ignore[no-untyped-def]
    shape = StepShape(batch=batch, context_tokens=batch * context_per_request)
    return step_cost(GPT_OSS, node, shape)


@pytest.mark.parametrize("node", ["h200", "gb300"])
def test_a_larger_batch_raises_throughput_more_than_compute_activity(node: str) -> None:
    small, large = cost(NODE_PRESETS[node], 8, 1024), cost(NODE_PRESETS[node], 20, 1024)
    throughput = (20 / large.step_s) / (8 / small.step_s)
    activity = large.compute_activity / small.compute_activity
    print(f"{node}: batch x2.5 -> throughput x{throughput:.3f}, compute activity x{activity:.3f}")
    assert throughput == pytest.approx(1.74, abs=0.10)
    assert activity == pytest.approx(1.44, abs=0.10)
    assert throughput - activity > 0.2  # the two are different measures


@pytest.mark.parametrize("node", ["h200", "gb300"])
def test_long_contexts_double_memory_traffic_but_cost_little_throughput(node: str) -> None:
    short, long = cost(NODE_PRESETS[node], 8, 1024), cost(NODE_PRESETS[node], 8, 82 * 1024)
    traffic = long.memory_activity / short.memory_activity
    change = short.step_s / long.step_s - 1.0
    print(f"{node}: context 1K -> 82K -> memory traffic x{traffic:.3f}, throughput {change:+.1%}")
    assert traffic == pytest.approx(2.0, abs=0.3)
    assert change == pytest.approx(-0.10, abs=0.05)


def test_sliding_window_layers_read_at_most_the_window() -> None:
    full = GPT_OSS.model_copy(update={"sliding_layers": 0, "sliding_window_tokens": 0})
    node = NODE_PRESETS["h200"]
    shape = StepShape(batch=8, context_tokens=8 * 50_000)
    windowed_kv = (
        step_cost(GPT_OSS, node, shape).bytes_moved
        - step_cost(GPT_OSS, node, StepShape(batch=8)).bytes_moved
    )
    full_kv = (
        step_cost(full, node, shape).bytes_moved
        - step_cost(full, node, StepShape(batch=8)).bytes_moved
    )
    # half the layers read the whole context, the other half 128 tokens per request
    per_layer = 2 * 8 * 64 * 2
    assert full_kv == pytest.approx(36 * 400_000 * per_layer)
    assert windowed_kv == pytest.approx(18 * 400_000 * per_layer + 18 * 8 * 128 * per_layer)


def test_expert_weights_read_grow_sublinearly_up_to_all_experts() -> None:
    r = roofline(GPT_OSS, NODE_PRESETS["h200"])
    expert_bytes = [r.groups(b, 0, 0, 0)[1][1] for b in (1, 8, 20, 64, 4096)]
    assert expert_bytes[0] == pytest.approx(r.expert_bytes * 4 / 128)  # one token: its 4 experts
    assert expert_bytes[2] / expert_bytes[1] < 20 / 8  # overlap: sub-linear in the batch
    assert expert_bytes[-1] == pytest.approx(r.expert_bytes, rel=1e-6)  # at most all experts
    assert expert_bytes == sorted(expert_bytes)


def test_host_work_hides_gpu_work_up_to_its_length() -> None:
    node = NodeProfile(
        name="n", flops_per_s=1e15, hbm_bytes_per_s=4e12, host_step_s=0.010,
        host_per_request_s=0.0, step_overhead_s=0.001, overlap_penalty=0.0,
    )  # fmt: skip
    light = step_cost(GPT_OSS, node, StepShape(batch=1, context_tokens=100))
    assert light.gpu_s < light.host_s and light.step_s == pytest.approx(0.011)
    heavy = step_cost(GPT_OSS, node, StepShape(prefill_tokens=8192))
    assert heavy.gpu_s > heavy.host_s and heavy.step_s == pytest.approx(heavy.gpu_s + 0.001)


def test_gpu_time_is_the_sum_of_per_kernel_roofline_times() -> None:
    """The calibration fit's per-kernel formula, summed over the step's kernel groups."""
    node = NODE_PRESETS["h200"]
    r = roofline(GPT_OSS, node)
    groups = r.groups(16, 16 * 3000, 512, 4096)
    c = r.cost(16, 16 * 3000, 512, 4096)
    assert c.gpu_s == pytest.approx(sum(kernel_time_s(node, f, b) for f, b in groups))
    assert c.flops == pytest.approx(sum(f for f, _ in groups))


def test_model_spec_refuses_inconsistent_moe_and_window_fields() -> None:
    base = GPT_OSS.model_dump()
    for bad in ({"experts_per_token": 200}, {"expert_params": 200e9}, {"sliding_layers": 40},
                {"sliding_window_tokens": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            ModelSpec(**{**base, **bad})


@given(
    st.sampled_from(sorted(MODEL_PRESETS)),
    st.sampled_from(sorted(NODE_PRESETS)),
    st.integers(0, 512),
    st.integers(0, 200_000),
    st.integers(0, 16_384),
    st.integers(0, 100_000),
)
def test_step_time_never_falls_when_work_is_added(model, node, batch, ctx, chunk, prefix) -> None:  # type: ignore[no-untyped-def]
    m, n = MODEL_PRESETS[model], NODE_PRESETS[node]
    base = step_time_s(m, n, StepShape(batch=batch, context_tokens=batch * ctx,
                                       prefill_tokens=chunk, prefix_tokens=prefix))  # fmt: skip
    for more in (
        StepShape(batch=batch + 1, context_tokens=batch * ctx + ctx, prefill_tokens=chunk,
                  prefix_tokens=prefix),
        StepShape(batch=batch, context_tokens=batch * ctx + 1000, prefill_tokens=chunk,
                  prefix_tokens=prefix),
        StepShape(batch=batch, context_tokens=batch * ctx, prefill_tokens=chunk + 64,
                  prefix_tokens=prefix),
    ):  # fmt: skip
        assert step_time_s(m, n, more) >= base - 1e-12


@given(
    st.sampled_from(sorted(MODEL_PRESETS)),
    st.sampled_from(sorted(NODE_PRESETS)),
    st.integers(0, 512),
    st.integers(0, 2_000_000),
    st.integers(0, 16_384),
    st.integers(0, 200_000),
)
def test_the_inlined_step_time_is_the_costed_one(model, node, batch, ctx, chunk, prefix) -> None:  # type: ignore[no-untyped-def]
    r = roofline(MODEL_PRESETS[model], NODE_PRESETS[node])
    assert r.step_s(batch, ctx, chunk, prefix) == pytest.approx(
        r.cost(batch, ctx, chunk, prefix).step_s, rel=1e-12, abs=1e-15
    )


def test_decode_kv_is_sized_from_hbm_less_weights_and_reserve_over_full_layer_bytes() -> None:
    """Issue 33 item 3: GPT-OSS-120B on an H200 (141 GB): 90 % of HBM, less 65.0 GB of weights
    and the 18 sliding layers' 128-token windows for 256 requests, over 18 full layers x 2 x 8
    heads x 64 x 2 bytes a token; an unknown HBM or weights that do not fit give 0."""
    from crossflow_ctl.domain.capacity import decode_kv_capacity_tokens

    gpt, h200 = MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"]
    assert gpt.weight_bytes == pytest.approx(2.1e9 * 2 + 114.7e9 * 0.53)
    windows = 18 * 128 * 2048 * 256
    expected = int((141e9 * 0.9 - gpt.weight_bytes - windows) // (18 * 2048))
    assert decode_kv_capacity_tokens(gpt, h200, 256) == expected
    assert 1_600_000 < expected < 1_700_000
    # a token on a sliding layer is not a token of capacity: all-full attention holds fewer
    full = gpt.model_copy(update={"sliding_layers": 0, "sliding_window_tokens": 0})
    assert decode_kv_capacity_tokens(full, h200, 256) == int(
        (141e9 * 0.9 - gpt.weight_bytes) // (36 * 2048)
    )
    assert decode_kv_capacity_tokens(gpt, h200.model_copy(update={"hbm_capacity_bytes": 0}), 8) == 0
    assert decode_kv_capacity_tokens(MODEL_PRESETS["glm-4.5"], h200, 256) == 0


def test_glm_5_2_caches_an_mla_latent_and_attends_to_a_top_k_of_past_tokens() -> None:
    """Issue 33 item 5: GLM-5.2 caches 576 latent values (bf16) and a 132-byte indexer key per
    token per layer, 78 layers; its attention reads at most 2,048 past tokens' latents a query
    while its indexer reads every past token's key, so a decode step grows with context far
    more slowly than a dense-attention model of the same cache would."""
    from crossflow_ctl.domain.capacity import decode_kv_capacity_tokens, server_profile

    glm = MODEL_PRESETS["glm-5.2"]
    assert glm.kv_bytes_per_token == 78 * (576 * 2 + 132)
    assert glm.weight_bytes == pytest.approx(744e9)
    gb300 = NODE_PRESETS["gb300"]
    assert decode_kv_capacity_tokens(glm, gb300, 256) == 0  # 744 GB do not fit 288 GB
    four = server_profile(gb300, 4)
    assert four.hbm_capacity_bytes == 4 * 288e9 and four.flops_per_s == 4 * gb300.flops_per_s
    assert server_profile(gb300, 4) is four and server_profile(gb300, 1) is gb300
    assert decode_kv_capacity_tokens(glm, four, 256) == int(
        (4 * 288e9 * 0.9 - 744e9) // (78 * (576 * 2 + 132))
    )
    r = roofline(glm, four)
    dense = roofline(glm.model_copy(update={"sparse_topk_tokens": 0}), four)
    short, long = 8 * 2_048, 8 * 100_000
    assert r.step_s(8, short) == pytest.approx(dense.step_s(8, short))  # nothing past top-k
    assert r.step_s(8, long) - r.step_s(8, short) < 0.5 * (
        dense.step_s(8, long) - dense.step_s(8, short)
    )
    # the indexer is not free: its reads grow with every past token
    no_indexer = roofline(glm.model_copy(update={"indexer_heads": 0}), four)
    assert r.step_s(8, long) > no_indexer.step_s(8, long)
    cost = r.cost(8, long, 512, 50_000)
    assert cost.step_s == pytest.approx(r.step_s(8, long, 512, 50_000))
