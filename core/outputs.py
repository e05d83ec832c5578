"""Output ownership and the one atomic writer, for files and for directories.

Every directory the project writes carries a marker file, MARKER, naming its kind
and the writer's version:

    build/internal-taper/.tapernorm-output.json   {"kind": "build", "writer": "tapernorm-deploy 0.2.0"}

A command replaces a directory only when it carries the marker of the kind that
command writes (OutputKind). Anything else is refused with one line naming the path
and the fix: a non-empty directory without the marker, a marker of another kind, a
file where a directory goes, the command's own input, a parent of it, or a path inside
an input folder. Nothing is guessed from file names. An empty directory holds nothing
to lose and may be filled.

Standalone files (a rewritten ONNX graph, a JSON report, a figure) carry their
signature inside: ONNX metadata `tapernorm.output`, a JSON key `tapernorm_output`,
a PNG text chunk `tapernorm.output`. An existing file is replaced only if it carries
the signature of the same kind.

Writing is atomic: into a temporary sibling with a unique name (never a fixed
`.X.old` that could be the user's), fsync'd, with the modes the user's umask gives
(0644 / 0755 by default), then swapped into place (one renameat2 RENAME_EXCHANGE on
Linux, so there is no moment without the old or the new output). The temporary is
removed on any exception, Ctrl-C and SIGTERM included (core.lifecycle.run_cli turns
SIGTERM into KeyboardInterrupt); the swap and the removal of the old output run
with SIGINT/SIGTERM blocked, so an interrupt lands before or after, never between.

A write that fails for want of room (a full disk or quota, a read-only file system) is one
core.errors.NoRoomError naming the output as the user will look for it: the file that failed,
under `out` rather than under the temporary, or `out` itself. Writers whose errors name no file
(safetensors, onnx, a plain file's write) name it with `writing(path)`.

    with output_dir("build/dyt", BUILD, inputs=[checkpoint]) as tmp:
        write files into tmp ...
    # tmp is now build/dyt, with its marker

    with output_file("m.fused.onnx", FUSED_ONNX, inputs=["m.onnx"]) as tmp:
        onnx.save(sign_onnx(proto, FUSED_ONNX), tmp)
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from core.errors import NO_ROOM, NoRoomError, UserError, io_errno
from core.lifecycle import (claimed_option, made_whole, no_room, note_claimed, note_committed, note_replaced_in,
                            signals_held)

WRITER = "tapernorm-deploy"
VERSION = "0.2.0"
MARKER = ".tapernorm-output.json"
SIGNATURE_KEY = "tapernorm.output"       # ONNX metadata key and PNG text keyword
JSON_SIGNATURE_KEY = "tapernorm_output"


@dataclass(frozen=True)
class OutputKind:
    name: str          # stored in the marker / signature
    what: str          # for messages: "a build directory"
    writer: str        # the command that writes it, for the fix in messages


CHECKPOINT = OutputKind("checkpoint", "a checkpoint directory", "python -m models.convert")
TRAINING_RUN = OutputKind("training-run", "a training run directory", "python -m train")
BUILD = OutputKind("build", "a build directory", "python -m export.build")
TRITON_REPOSITORY = OutputKind("triton-repository", "a Triton model repository", "python -m runtime.triton repo")
BENCH_RESULTS = OutputKind("bench-results", "a benchmark results directory", "python -m bench.decode")
BENCH_CACHE = OutputKind("bench-cache", "a benchmark build cache", "python -m bench.decode --cache")
SERVE_RESULTS = OutputKind("serve-results", "a serving benchmark results directory", "python -m bench.serve")
FUSED_ONNX = OutputKind("onnx", "an ONNX graph", "python -m graph_passes")
REPORT_JSON = OutputKind("report-json", "a JSON report", "tapernorm-deploy")
FIGURE = OutputKind("figure", "a figure", "tapernorm-deploy")
TOKENIZER = OutputKind("tokenizer", "a tokenizer file", "python -m train.tokenizer")
TOKEN_SHARDS = OutputKind("token-shards", "a token shard directory", "python -m train.shards")
SCALE_FOLDER = OutputKind("scale-folder", "a random-init model folder", "python -m bench.scale make")

def marker_stamp(path: Path) -> tuple | None:
    """(inode, mtime) of a directory's marker, None without one: a new write of the directory has a new
    marker file, so a caller that ran a child writer can tell whether it completed."""
    try:
        st = (Path(path) / MARKER).stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _umask() -> int:
    try:        # Linux >= 4.7 reports it without the set-and-restore race
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~_umask()


def dir_mode() -> int:
    return 0o777 & ~_umask()


# --- ownership -------------------------------------------------------------------------------

def read_marker(path: Path) -> dict | None:
    """The marker of a directory, or None when it has none (or an unreadable one)."""
    try:
        data = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("writer", "").startswith(WRITER) else None


def marker_kind(path: Path) -> str | None:
    m = read_marker(path)
    return None if m is None else m.get("kind")


def is_earlier_output(path: str | os.PathLike, kind: OutputKind, made_after: str | os.PathLike | None = None) -> bool:
    """Whether `path` is a finished output of `kind` that this project wrote: the one test a command makes
    before it reuses (skips rebuilding) something it finds at one of its own paths. Only the marker
    decides, never a file name inside: a folder of the user's that happens to hold a `model.int4.onnx` or a
    `genai_config.json` is not ours (issue 42: a benchmark timed someone else's graph). A temporary
    (a marker with `temporary_of`) or a symbolic link is never one.

    made_after: the marked output this one was made from; `path` counts only when its marker is at least
    as new as that one's (an input written again since leaves its derived outputs stale)."""
    p = Path(path)
    m = read_marker(p)
    if p.is_symlink() or not p.is_dir() or m is None or m.get("kind") != kind.name or "temporary_of" in m:
        return False
    if made_after is None:
        return True
    mine, theirs = marker_stamp(p), marker_stamp(Path(made_after))
    return mine is not None and theirs is not None and mine[1] >= theirs[1]


def _check_related(out: Path, inputs, what: str, option: str) -> None:
    """Refuse (UserError `<out>: <why>; <fix>`) an `out` the command's inputs rule out.

    Besides the input itself and a folder holding it, a path inside an input folder is refused:
    writing there changes what the command reads (models.convert HF --out HF/ckpt), and a later
    run over that folder would read its own output."""
    o = out.resolve()
    for inp in inputs or ():
        if inp is None:
            continue
        i = Path(inp).resolve()
        replaces = f"and writing {what} there would replace it; choose another {option}"
        if o == i:
            raise UserError(f"{out}: it is the command's own input {inp}, {replaces}")
        if o in i.parents:
            raise UserError(f"{out}: it holds the command's own input {inp}, {replaces}")
        if i in o.parents:
            raise UserError(f"{out}: it is inside the command's input {inp}, and writing {what} there would change "
                            f"that input; choose another {option} outside {inp}")


def check_output_dir(out: str | os.PathLike, kind: OutputKind, inputs=(), option: str = "--out") -> None:
    """Refuse (UserError) an output directory the command may not create or replace; see the module
    docstring. `option` names the command-line option the fix points at."""
    out = Path(out)
    fix = f"choose another {option}"
    _check_related(out, inputs, kind.what, option)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        found = "a symbolic link" if out.is_symlink() else "a file"
        raise UserError(f"{out}: expected {kind.what} or a new path, found {found}; {fix} (it is not ours to replace)")
    if out.is_dir():
        found = marker_kind(out)
        if found is None:
            try:
                empty = not any(out.iterdir())
            except OSError as e:
                raise UserError(f"{out}: cannot be read ({e.strerror}); {fix}") from None
            if not empty:
                raise UserError(f"{out}: exists and holds files tapernorm-deploy did not write (no {MARKER}); "
                                f"{fix}, or move those files away yourself")
        elif found != kind.name:
            raise UserError(f"{out}: holds a {found} written by tapernorm-deploy, not {kind.what}; {fix}")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{out}: cannot be created ({parent} is a file); {fix}")
    if _read_only(parent):
        raise no_room(out, errno.EROFS, option)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{out}: cannot be created (no write permission on {parent}); {fix}")


def _read_only(directory: Path) -> bool:
    """Whether `directory` is on a read-only mount (os.access then says only "no write permission")."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


FILE_OPTION = "output path"       # the fix of a standalone file's messages (its option differs per command)


def file_signature(path: Path) -> str | None:
    """The kind signed into a file we wrote (ONNX / JSON / PNG), else None."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        if head.startswith(b"\x89PNG"):
            return _png_signature(path)
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            return data.get(JSON_SIGNATURE_KEY) if isinstance(data, dict) else None
        if path.suffix == ".onnx":
            import onnx
            proto = onnx.load(str(path), load_external_data=False)
            return next((p.value for p in proto.metadata_props if p.key == SIGNATURE_KEY), None)
    except Exception:  # unreadable, not JSON, not ONNX: not ours
        return None
    return None


def _png_signature(path: Path) -> str | None:
    import struct
    data = path.read_bytes()
    i = 8
    while i + 8 <= len(data):
        length, ctype = struct.unpack(">I4s", data[i:i + 8])
        if ctype == b"tEXt":
            key, _, value = data[i + 8:i + 8 + length].partition(b"\0")
            if key.decode("latin-1") == SIGNATURE_KEY:
                return value.decode("latin-1")
        if ctype == b"IEND":
            break
        i += 12 + length
    return None


def check_output_file(out: str | os.PathLike, kind: OutputKind, inputs=()) -> None:
    """Refuse (UserError) an output file the command may not create or replace."""
    out = Path(out)
    fix = "choose another output path"
    _check_related(out, inputs, kind.what, "output path")
    if out.is_dir():
        raise UserError(f"{out}: expected a file path for {kind.what}, found a directory; {fix} (e.g. {out / 'out'}"
                        f"{'.onnx' if kind is FUSED_ONNX else ''})")
    if out.is_symlink() or (out.exists() and file_signature(out) != kind.name):
        raise UserError(f"{out}: exists and was not written by tapernorm-deploy as {kind.what}; {fix}, "
                        "or move the file away yourself")
    if not out.parent.is_dir():
        raise UserError(f"{out}: its folder {out.parent} does not exist; create it or {fix}")
    if _read_only(out.parent):
        raise no_room(out, errno.EROFS, FILE_OPTION)
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise UserError(f"{out}: cannot be written (no write permission on {out.parent}); {fix}")


def sign_json(data: dict, kind: OutputKind) -> dict:
    return {JSON_SIGNATURE_KEY: kind.name, "written_by": f"{WRITER} {VERSION}", **data}


def sign_onnx(proto, kind: OutputKind = FUSED_ONNX):
    """Set the ONNX metadata signature (in place; returns proto)."""
    for p in list(proto.metadata_props):
        if p.key == SIGNATURE_KEY:
            proto.metadata_props.remove(p)
    proto.metadata_props.add(key=SIGNATURE_KEY, value=kind.name)
    return proto


def png_signature_metadata(kind: OutputKind = FIGURE) -> dict:
    """matplotlib savefig(metadata=...) for a signed PNG."""
    return {SIGNATURE_KEY: kind.name, "Software": f"{WRITER} {VERSION}"}


# --- the atomic writer -------------------------------------------------------------------------

@contextlib.contextmanager
def writing(path: str | os.PathLike):
    """Name `path` in a failed write inside whose error names no file (safetensors' SafetensorError, onnx.save,
    a plain file's write): it becomes an OSError of the same errno naming `path`."""
    try:
        yield
    except BaseException as e:
        code = io_errno(e)
        if code is None or getattr(e, "filename", None) or isinstance(e, NoRoomError):
            raise
        raise OSError(code, os.strerror(code), str(path)) from e


def _as_output(path, tmp: Path | None, out: Path) -> Path:
    """`path` (a file under the temporary `tmp`, or `tmp` itself) as it is named once at `out`; else `out`."""
    if not isinstance(path, (str, bytes, os.PathLike)) or tmp is None:      # None, or a file descriptor
        return out
    p, t = os.path.abspath(os.fsdecode(path)), os.path.abspath(tmp)
    return Path(str(out) + p[len(t):]) if p == t or p.startswith(t + os.sep) or p.startswith(t + ".") else out


@contextlib.contextmanager
def naming_output(out: str | os.PathLike, tmp: Path | None = None, option: str = "--out"):
    """A write inside that fails for want of room as one NoRoomError naming the output `out` (the file under
    `tmp` that failed, as it would be named under `out`); any other error as it is."""
    try:
        yield
    except NoRoomError:
        raise
    except BaseException as e:
        code = io_errno(e)
        if code not in NO_ROOM:
            raise
        written = getattr(e, "filename2", None) or getattr(e, "filename", None)   # a copy's: (source, destination)
        raise no_room(_as_output(written, tmp, Path(out)), code, option) from None


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync(path, flags: int = os.O_RDONLY) -> None:
    """A file's data (with O_DIRECTORY: a directory's entries) on disk before a rename publishes it."""
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:         # a file system that cannot sync a directory: the rename stands regardless
        pass


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _new_file(prefix: str, directory: Path) -> Path:
    """A new, unique, empty file in `directory` (mkstemp), made whole (_made_whole)."""
    def make():
        fd, name = tempfile.mkstemp(prefix=prefix, dir=directory)
        os.close(fd)
        return Path(name)
    return made_whole(make, lambda path: path.unlink(missing_ok=True))


def _commit_dir(tmp: Path, out: Path) -> None:
    """Put the finished tmp at `out`; an existing `out` (already checked to be ours) is removed after."""
    with signals_held():
        if out.exists():
            if _exchange(tmp, out):
                shutil.rmtree(tmp, ignore_errors=True)     # tmp now holds the old output
            else:
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))  # unique, empty
                os.replace(out, old)                      # rename(2) may replace an empty directory
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        _fsync_dir(out.parent)
        note_committed(out)


def write_marker(directory: Path, kind: OutputKind, extra: dict | None = None) -> None:
    data = {"kind": kind.name, "writer": f"{WRITER} {VERSION}", **(extra or {})}
    p = Path(directory) / MARKER
    with writing(p):
        p.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.chmod(p, file_mode())


def _fix_modes(root: Path) -> None:
    """Files created through mkstemp/mkdtemp-like APIs come out 0600/0700: give them the umask's modes."""
    fm, dm = file_mode(), dir_mode()
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p) and (os.stat(p).st_mode & 0o777) != dm:
                os.chmod(p, dm)
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p) and (os.stat(p).st_mode & 0o777) != fm and os.stat(p).st_nlink == 1:
                os.chmod(p, fm)


def _process_gone(pid) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, TypeError, ValueError, OverflowError):  # alive but another user's, or no pid: keep it
        return False
    return False


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary siblings of `out` (.NAME.<role>-*) that a process of this machine, now gone,
    left: a SIGKILL or a power cut cannot run the cleanup below. Only a directory that carries our
    temporary marker (temporary_dir) is removed, never one without it, nor one of a live process or
    another machine. Returns what was removed."""
    removed = []
    try:
        candidates = [p for p in out.parent.glob(f".{glob.escape(out.name)}.*-*") if p.is_dir() and not p.is_symlink()]
    except OSError:
        return removed
    for p in candidates:
        m = read_marker(p) or {}
        if (m.get("temporary_of") == out.name and m.get("host") == socket.gethostname()
                and _process_gone(m.get("pid"))):
            _remove_marker_last(p)
            removed.append(p)
    return removed


def _remove_marker_last(folder: Path) -> None:
    """Remove a marked folder, its marker last: stopped midway, what is left still says whose it is."""
    for child in folder.iterdir():
        if child.name != MARKER:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def temporary_dir(out: Path, role: str, kind: OutputKind) -> Path:
    """A new, unique directory beside `out` (.NAME.ROLE-xxxx) marked as this process's temporary of
    `out`, so that a later run can tell it from the user's and remove it once this process is gone
    (remove_stale_temporaries, called first)."""
    out = Path(out)
    remove_stale_temporaries(out)

    def make():
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{role}-", dir=out.parent))      # unique, empty
        try:        # an error here must not leave the folder unmarked (nothing would ever remove it)
            os.chmod(tmp, dir_mode())
            write_marker(tmp, kind, {"temporary_of": out.name, "pid": os.getpid(), "host": socket.gethostname()})
        except BaseException:
            _remove_dir(tmp)
            raise
        return tmp
    return made_whole(make, _remove_dir)


@contextlib.contextmanager
def output_dir(out: str | os.PathLike, kind: OutputKind, inputs=(), marker: dict | None = None,
               option: str = "--out"):
    """Write a directory atomically: yields a temporary sibling (temporary_dir: it holds its marker
    from the start); on success it becomes `out`.

    `out` is checked first (check_output_dir) and again just before the swap, so a
    directory that changed hands meanwhile is still refused. `option` names the command-line
    option of `out` in messages.
    """
    out = Path(out)
    check_output_dir(out, kind, inputs, option)
    tmp = None
    try:
        with naming_output(out, option=option):
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = temporary_dir(out, "tmp", kind)
        with naming_output(out, tmp, option):
            os.chmod(tmp, dir_mode())
            yield tmp
            write_marker(tmp, kind, marker)
            _fix_modes(tmp)
            _fsync_tree(tmp)
            check_output_dir(out, kind, inputs, option)
            _commit_dir(tmp, out)
    except BaseException:
        if tmp is not None:
            _remove_dir(tmp)
        raise


@contextlib.contextmanager
def output_file(out: str | os.PathLike, kind: OutputKind, inputs=()):
    """Write one file atomically: yields a temporary path beside `out`; on success it replaces `out`.

    The caller signs the content (sign_onnx / sign_json / png_signature_metadata) so a
    later run may replace it.
    """
    out = Path(out)
    check_output_file(out, kind, inputs)
    tmp = None
    try:
        with naming_output(out, option=FILE_OPTION):
            tmp = _new_file(f".{out.name}.tmp-", out.parent)
        with naming_output(out, tmp, FILE_OPTION):
            yield tmp
            os.chmod(tmp, file_mode())
            _fsync(tmp)
            check_output_file(out, kind, inputs)
            with signals_held():
                os.replace(tmp, out)
                _fsync_dir(out.parent)
                note_committed(out)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
            for extra in out.parent.glob(f"{tmp.name}*"):   # e.g. external data written beside it
                extra.unlink(missing_ok=True)
        raise


def write_json(out: str | os.PathLike, data: dict, kind: OutputKind = REPORT_JSON, inputs=()) -> Path:
    """A signed JSON file, written atomically."""
    with output_file(out, kind, inputs) as tmp:
        tmp.write_text(json.dumps(sign_json(data, kind), indent=1) + "\n", encoding="utf-8")
    return Path(out)


def claim_dir(out: str | os.PathLike, kind: OutputKind, inputs=(), option: str = "--out") -> Path:
    """A directory the command fills file by file (each file atomically, replace_file_in), e.g.
    benchmark results that must survive an interrupted run: created (or reused when it carries
    our marker of this kind) and marked at once. The files replaced in it afterwards are this
    command's outputs in its stop messages (`complete: ...`). Returns the directory."""
    out = Path(out)
    check_output_dir(out, kind, inputs, option)
    created = not out.exists()
    with naming_output(out, option=option):
        out.mkdir(parents=True, exist_ok=True)
        if created:
            os.chmod(out, dir_mode())
        if marker_kind(out) is None:
            write_marker(out, kind)
    note_claimed(out, option)
    return out


@contextlib.contextmanager
def replaced_file_in(directory: Path, name: str):
    """Atomically (re)write one file inside a directory we own (a marked one): yields a temporary
    path beside it for a writer that takes a path (core.onnx_writer.save_onnx); on success it
    replaces `name`. A graph written with external data would name the temporary in its
    location, so this is for graphs kept inline (below core.onnx_writer.EXTERNAL_AT; above it,
    core.onnx_writer.replaced_graph_in)."""
    directory = Path(directory)
    option = claimed_option(directory) or FILE_OPTION
    tmp = None
    try:
        with naming_output(directory / name, option=option):
            tmp = _new_file(f".{name}.tmp-", directory)
        with naming_output(directory / name, tmp, option):
            yield tmp
            _fsync(tmp)
            os.chmod(tmp, file_mode())
            with signals_held():
                os.replace(tmp, directory / name)
                note_replaced_in(directory, name)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def replaced_files_in(directory: Path, names: tuple[str, ...]):
    """replaced_file_in for files written together, under their own names (a graph records the name of its
    weights' file, core.onnx_writer.replaced_graph_in): yields a temporary folder inside `directory` to write
    them in; on success each replaces its namesake in `directory`, in the order of `names`; nothing is left
    otherwise."""
    directory = Path(directory)
    with contextlib.ExitStack() as replaced:
        tmps = {name: replaced.enter_context(replaced_file_in(directory, name)) for name in reversed(names)}
        work = made_whole(lambda: Path(tempfile.mkdtemp(prefix=f".{names[-1]}.tmp-", dir=directory)), _remove_dir)
        try:
            yield work
            for name in names:
                os.replace(work / name, tmps[name])
        finally:
            shutil.rmtree(work, ignore_errors=True)


def replace_file_in(directory: Path, name: str, data: bytes | str) -> Path:
    """Atomically (re)write one file inside a directory we own (a marked one)."""
    with replaced_file_in(directory, name) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(directory) / name
