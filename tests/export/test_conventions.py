"""export.verify on the I/O conventions of other exporters: detection, driving, one-line refusals."""
import subprocess

import numpy as np
import onnx
import pytest

from core.contract import ContractError
from export.conventions import detect
from export.verify import VerificationError, ort_session, verify_pair
from graph_passes import run_passes
from tests.export.exported import save
from tests.export.hf_style import kv_cache_decoder, logits_only

VARIANTS = {"kv-cache": dict(past=True), "prefill-only": dict(past=False), "merged": dict(merged=True)}


@pytest.mark.parametrize("variant", list(VARIANTS) + ["logits-only"])
def test_each_convention_is_detected_folded_and_equal(variant):
    m = logits_only(kv_cache_decoder(past=False)) if variant == "logits-only" else kv_cache_decoder(**VARIANTS[variant])
    conv = detect(m)
    assert conv.name == ("kv-cache" if variant == "merged" else variant)
    assert conv.merged == (variant == "merged")
    fused, results = run_passes(m)
    assert sum(len(r.folded) for r in results if r.name == "channel_scale") == (2 if variant == "merged" else 1)
    outputs = {"logits"} if variant == "logits-only" else {"logits", "present.0.key", "present.0.value"}
    for c in verify_pair(m, fused):
        assert set(c.max_abs_diff) == outputs and c.worst <= 1e-5
    with pytest.raises(VerificationError, match="logits: max abs diff"):
        verify_pair(m, kv_cache_decoder(**VARIANTS.get(variant, dict(past=False)), gamma_scale=1.001)
                    if variant != "logits-only" else logits_only(kv_cache_decoder(past=False, gamma_scale=1.001)))


def test_decode_steps_feed_the_presents_back():
    """The kv-cache driver's last-token logits equal a full recompute of the same prefix."""
    with_past, prefill = detect(kv_cache_decoder(past=True)), detect(kv_cache_decoder(past=False))
    (_, plan), = with_past.sessions(seeds=(3,))
    steps = with_past.run(ort_session(kv_cache_decoder(past=True)), plan)
    full = prefill.run(ort_session(kv_cache_decoder(past=False)), plan)
    assert len(steps) == len(full) == 4                      # prefill + 3 decode steps
    for s, f in zip(steps, full):
        np.testing.assert_allclose(s["logits"][:, -1], f["logits"][:, -1], atol=1e-5)
        np.testing.assert_allclose(s["present.0.key"], f["present.0.key"], atol=0)


def test_merged_runs_both_branches():
    """use_cache_branch False at the prefill, True after: the merged toy equals the kv-cache one."""
    merged, plain = detect(kv_cache_decoder(merged=True)), detect(kv_cache_decoder(past=True))
    (_, plan), = merged.sessions(seeds=(0,))
    a = merged.run(ort_session(kv_cache_decoder(merged=True)), plan)
    b = plain.run(ort_session(kv_cache_decoder(past=True)), plan)
    for x, y in zip(a, b):
        for name in x:
            np.testing.assert_allclose(x[name], y[name], atol=1e-6, err_msg=name)


def test_unknown_convention_is_one_line_naming_what_it_found():
    m = kv_cache_decoder(past=False)
    m.graph.input[1].name = "attn_mask"
    for node in m.graph.node:
        node.input[:] = ["attn_mask" if i == "attention_mask" else i for i in node.input]
    with pytest.raises(ContractError) as e:
        detect(m, "other.onnx")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("other.onnx: unknown decoder I/O convention")
    assert "attn_mask" in msg and "known conventions: ours" in msg and "Optimum / ONNX Runtime GenAI" in msg


def test_different_conventions_are_not_equal():
    with pytest.raises(VerificationError, match="second graph is Optimum without past"):
        verify_pair(kv_cache_decoder(past=True), kv_cache_decoder(past=False))


def _cli(capsys, *args):
    """python -m export.verify ARGS, in this process (a subprocess would pay the imports each time)."""
    from export.verify import main
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_cli_detects_drives_and_compares_against_a_reference(capsys):
    m = kv_cache_decoder(merged=True)
    fused, _ = run_passes(m)
    a, b = save(m, "toy_merged.onnx"), save(fused, "toy_merged.fused.onnx")
    r = _cli(capsys, a, b, "--reference", a)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "convention: Optimum/GenAI kv-cache (1 layers, merged with use_cache_branch, fp32)" in r.stdout
    assert "second graph vs reference: random tokens, seed 0: 3 output(s)" in r.stdout and "EQUAL" in r.stdout
    bad = save(kv_cache_decoder(merged=True, gamma_scale=1.01), "toy_merged.bad.onnx")
    r = _cli(capsys, a, b, "--reference", bad)
    assert r.returncode == 1 and "first graph vs reference: random tokens, seed 0: logits" in r.stdout
    assert "NOT EQUAL" in r.stdout
    odd = onnx.ModelProto()
    odd.CopyFrom(m)
    odd.graph.output[0].name = "scores"
    odd.graph.node[0].output[0] = "scores"
    r = _cli(capsys, save(odd, "toy_odd.onnx"), b)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "unknown decoder I/O convention" in r.stderr and "scores" in r.stderr


def test_genai_head_dim_is_read_from_its_group_query_attention():
    """ONNX Runtime GenAI declares the cache [batch, H, past, 'kv_cache_dim']: the head size comes
    from GroupQueryAttention(packed QKV MatMul [hidden, (num_heads + 2 kv_num_heads) * head_dim])."""
    from onnx import TensorProto, helper, numpy_helper
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"])] + \
          [helper.make_tensor_value_info(f"past_key_values.0.{kv}", TensorProto.FLOAT, ["b", 1, "p", "kv_cache_dim"])
           for kv in ("key", "value")]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 7])] + \
           [helper.make_tensor_value_info(f"present.0.{kv}", TensorProto.FLOAT, ["b", 1, "t", "kv_cache_dim"])
            for kv in ("key", "value")]
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["e"]),
             helper.make_node("MatMul", ["e", "Wqkv"], ["qkv"]),
             helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key_values.0.key", "past_key_values.0.value"],
                              ["a", "present.0.key", "present.0.value"], domain="com.microsoft", num_heads=2, kv_num_heads=1),
             helper.make_node("MatMul", ["a", "W"], ["logits"])]
    inits = [numpy_helper.from_array(np.zeros(shape, np.float32), n)
             for n, shape in (("E", (7, 32)), ("Wqkv", (32, 4 * 16)), ("W", (32, 7)))]
    conv = detect(helper.make_model(helper.make_graph(nodes, "genai", ins, outs, inits)))
    assert conv.name == "kv-cache" and [t.shape for t in conv.past] == [(None, 1, None, 16)] * 2
