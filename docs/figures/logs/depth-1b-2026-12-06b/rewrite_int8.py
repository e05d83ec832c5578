"""For speed only: the 1B fp32-cache build's graph rewritten as export/kv_int8.py does (scales calibrated on the
first half of CHECK_TEXT, with_int8_cache, with_fp32_first_prompt), WITHOUT its drift check, which this
random-init folder fails (7.41 % > 5 %, build-int8.log). Written beside the build as model.int8cache.onnx,
sharing its weights file."""
import sys
from pathlib import Path
import onnx
sys.path.insert(0, "/work/main")
from core.contract import contract_of
from core.decode import DecodeDriver, graph_step
from core.onnx_writer import save_onnx
from export.kv_int8 import _session, check_tokens
from graph_passes.ort_attention import int8_scales, rotated_key_caches, with_fp32_first_prompt, with_int8_cache
build = Path(sys.argv[1])
path = build / "model.int4.onnx"
contract = contract_of(path)
ids, text = check_tokens(build / "tokenizer.json", contract.vocab_size, contract.capacity)
cal = len(ids) // 2
proto = onnx.load(str(path), load_external_data=False)
rotated = rotated_key_caches(proto)
with _session(path) as sess:
    driver = DecodeDriver(graph_step(sess), contract, 1)
    driver.prefill([ids[:cal]])
    scales = {n: int8_scales(c[:, :, :cal], n in rotated) for n, c in driver.caches.items()}
with_fp32_first_prompt(with_int8_cache(proto, scales))
save_onnx(proto, build / "model.int8cache.onnx")
print("wrote", build / "model.int8cache.onnx", text, "calibration", cal)
