"""Every zoo model built by the code before issue 35 (worktree /work/old, 1f560ba) and after (this tree),
the same options; the graphs of both run on the same sessions (export.verify's conventions, ORT, no
optimizations): max |d| of every output, per model and option set."""
import json, subprocess, sys, os
from pathlib import Path
import numpy as np

ZOO = sorted(p.name for p in Path("/work/main/models/zoo").iterdir() if (p / "config.json").is_file())
OPTIONS = {"fuse": ["--fuse"], "fuse-portable": ["--fuse", "--target", "portable"],
           "int4": ["--fuse", "--quantize", "int4"]}
OUT = Path("/work/cmp/builds")

def build(tree: str, model: str, name: str, argv: list[str]) -> Path:
    out = OUT / f"{tree}-{model}-{name}"
    if not (out / "report.json").is_file():
        env = {**os.environ, "PYTHONPATH": f"/work/{tree}"}
        r = subprocess.run([sys.executable, "-m", "export.build", "--checkpoint", f"/work/main/models/zoo/{model}",
                            "--out", str(out), *argv], cwd=f"/work/{tree}", env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{tree} {model} {name}: {r.stderr.strip().splitlines()[-1][:300]}")
    return out

def graph(folder: Path, name: str) -> Path:
    return folder / ("model.int4.onnx" if name == "int4" else "model.fused.onnx")

def main():
    sys.path.insert(0, "/work/main")
    from export.verify import ort_session, read_interface, run_onnx
    from export.conventions import verification_sessions
    from export.pipeline import real_tokens
    rows = []
    for model in ZOO:
        tokens = real_tokens(Path(f"/work/main/models/zoo/{model}/tokenizer.json"), 10 ** 9)
        for name, argv in OPTIONS.items():
            try:
                a, b = graph(build("old", model, name, argv), name), graph(build("main", model, name, argv), name)
            except RuntimeError as e:
                row = {"model": model, "options": name, "failed": str(e)}
                rows.append(row); print(json.dumps(row), flush=True)
                continue
            iface = read_interface(str(a))
            sessions = verification_sessions(iface, tokens, same_start=True)
            ra = [run_onnx(ort_session(a), iface, s) for _, s in sessions]
            rb = [run_onnx(ort_session(b), iface, s) for _, s in sessions]
            worst = {}
            for x, y in zip(ra, rb):
                for sx, sy in zip(x, y):
                    for k in sx:
                        worst[k.split("_")[0] if k != "logits" else k] = max(worst.get(k, 0.0), float(np.abs(sx[k].astype(np.float64) - sy[k]).max()))
            scale = max(float(np.abs(s["logits"]).max()) for x in ra for s in x)
            row = {"model": model, "options": name, "logits_max_abs_diff": worst["logits"],
                   "all_outputs_max_abs_diff": max(worst.values()), "max_abs_logit": scale}
            rows.append(row); print(json.dumps(row), flush=True)
    Path("/work/cmp/zoo_before_after.json").write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()
