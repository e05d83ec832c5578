"""The torch-free bottom layer every package builds on.

    core.errors     UserError (the one user-error type), its exit codes, ArgumentParser, range-checked
                    argparse types
    core.lifecycle  a command's process lifecycle: run_cli (the CLI runner), exit_after, Ctrl-C / SIGTERM
                    handling, signal holding, the registry of the outputs a command completed
    core.outputs    output ownership markers and the one atomic writer (directories and files)
    core.onnx_writer  the one ONNX writer (inline or external weights), on core.outputs
    core.contract   the decode-step contract: graph I/O names (spelled only here), dims, dtypes, capacity;
                    ONNX file checks
    core.decode     the one driver of the contract over a step function: prefill, steps, cache feed-back,
                    greedy generation, top-1 agreement (export.verify, the quantize check, bench's runners,
                    runtime.step_timing all call it)
    core.inputs     boundary checks: text files, memory estimates
    core.build_files  a build folder's file names (graphs, tokenizer, report), for writers and readers

Layers, bottom to top (tests/test_layers.py enforces them): core; models, graph_passes;
train, export; runtime; bench. Nothing here imports torch or a package above.
"""
from core.errors import UserError
from core.lifecycle import run_cli

__all__ = ["UserError", "run_cli"]
