"""Key -> file path mapping, byte-identical to vLLM 0.33's FileMapper (no vLLM needed).

A block is identified by a key ``(block_hash: bytes, group_idx: int)``.  Its file is::

    <root>/<model>_<digest>_r<rank>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin

where ``h`` is the lowercase hex of the block hash, ``model`` is the model name with
``/`` replaced by ``_`` and ``digest`` is the first 12 hex characters of the SHA-256 of
``json.dumps(fields, sort_keys=True, separators=(",", ":"))``.  ``fields`` is written to
``<root>/<model>_<digest>/config.json`` (``json.dump(indent=2, sort_keys=True)``, no
trailing newline, only if absent).  The paths are plain f-strings, as vLLM's: a trailing
``/`` in ``root_dir`` gives ``//`` in every path (and the same ``//`` as vLLM).

Hashed fields, as ``vllm/v1/kv_offload/file_mapper.py`` of vLLM 0.33 (so the same
deployment gives the same directory, and a cache written by vLLM's ``"fs"`` tier is found
by kvtier and the other way round; tests/test_file_mapper.py holds golden paths made by
vLLM 0.33, tests/test_vllm.py compares with the installed vLLM over a matrix):

============================  =========================================================
``model_name``                model id, e.g. ``"meta-llama/Llama-3.1-8B"``
``tokens_per_hash``           tokens per block hash (vLLM ``cache.tokens_per_hash``)
``blocks_per_file``           engine blocks in one file (vLLM: ``blocks_per_chunk``)
``tp_size`` ``pp_size``       tensor / pipeline parallel sizes (1 when parallel-agnostic)
``pcp_size`` ``dcp_size``     prefill / decode context parallel sizes (idem)
``dtype``                     KV cache dtype name, e.g. ``"bfloat16"`` (no ``torch.``)
``kv_cache_groups``           list of ``{"tokens_per_block": int, "layer_names": [str]}``
``inference_engine``          ``"vllm"``
``parallel_agnostic``         ``false``, present only when not parallel-agnostic
``replicated_layout``         ``true``, present only when set
``canonical_format``          e.g. ``"v1-nhd"``, present only when set
============================  =========================================================

Why these: every field changes either the bytes of a block (dtype, layers in a group,
tokens per block, blocks per file, the tensor/context split of heads, the byte format) or
which rank owns it, so two configurations that could produce different bytes for the same
hash never share a directory.  The rank is not hashed (it is the ``_r<rank>`` suffix) so
all ranks of one deployment share one ``config.json``.  The block size in bytes is not
hashed (it follows from the fields); kvtier records it beside ``config.json`` in
``kvtier.json`` (:func:`write_block_info`) so ``kvtier scrub`` can check file sizes.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any, Mapping, Optional, Sequence, Tuple

#: Hex characters of the SHA-256 digest in the directory name (vLLM ``_BASE_PATH_HASH_LEN``).
DIGEST_HEX_LEN = 12
CONFIG_FILENAME = "config.json"
#: kvtier-only sidecar with facts that are not hashed (block size in bytes).
BLOCK_INFO_FILENAME = "kvtier.json"

Key = Tuple[bytes, int]

#: Field names hashed into the directory digest, in vLLM's order (the last three only
#: under the conditions of the module docstring).
HASHED_FIELDS = (
    "model_name",
    "tokens_per_hash",
    "blocks_per_file",
    "tp_size",
    "pp_size",
    "pcp_size",
    "dcp_size",
    "dtype",
    "kv_cache_groups",
    "inference_engine",
    "parallel_agnostic",
    "replicated_layout",
    "canonical_format",
)


def check_root_dir(root_dir: Any) -> str:
    """``root_dir`` as a str, checked before anything resolves it: TypeError unless a str or
    os.PathLike of text, ValueError naming ``root_dir`` when it is empty (``""`` would be
    the working directory once made absolute) or holds a NUL byte."""
    if not isinstance(root_dir, (str, os.PathLike)):
        raise TypeError(f"root_dir must be a str or os.PathLike, got {type(root_dir).__name__}")
    root = os.fspath(root_dir)
    if not isinstance(root, str):
        raise TypeError("root_dir must be a text path")
    if not root:
        raise ValueError("root_dir must not be empty: give the tier's root directory (\"\" would be the working "
                         "directory)")
    if "\0" in root:
        raise ValueError(f"root_dir must not contain a NUL byte: {root!r}")
    return root


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def dtype_name(dtype: Any) -> str:
    """Canonical KV dtype name as vLLM hashes it: ``str(dtype)`` without ``torch.``.

    Accepts a str (``"bfloat16"``), a numpy dtype/type (its ``name``) or a torch dtype.
    Raises TypeError for anything else, ValueError for an empty name.
    """
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype)  # torch.bfloat16 -> "torch.bfloat16"
    else:
        import numpy as np

        if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
            name = np.dtype(dtype).name
        else:
            raise TypeError(f"dtype must be a str, numpy dtype or torch dtype, got {type(dtype).__name__}")
    name = name.replace("torch.", "")
    if not name:
        raise ValueError("dtype must be a non-empty name")
    return name


def _check_groups(groups: Optional[Sequence[Mapping]]) -> list:
    if groups is None:
        return []
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)):
        raise TypeError("kv_cache_groups must be a list of dicts")
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, Mapping):
            raise TypeError(f"kv_cache_groups[{i}] must be a dict, got {type(g).__name__}")
        unknown = set(g) - {"tokens_per_block", "layer_names"}
        missing = {"tokens_per_block", "layer_names"} - set(g)
        if unknown or missing:
            raise ValueError(
                f"kv_cache_groups[{i}] must have exactly the keys 'tokens_per_block' and 'layer_names'"
                f" (missing {sorted(missing)}, unknown {sorted(unknown)})"
            )
        bs = _check_int(f"kv_cache_groups[{i}]['tokens_per_block']", g["tokens_per_block"], 1)
        names = g["layer_names"]
        if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)) \
                or not all(isinstance(n, str) for n in names):
            raise TypeError(f"kv_cache_groups[{i}]['layer_names'] must be a list of str")
        out.append({"tokens_per_block": bs, "layer_names": list(names)})
    return out


def fields_digest(fields: Mapping) -> str:
    """First :data:`DIGEST_HEX_LEN` hex chars of SHA-256 over the canonical JSON of ``fields``."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:DIGEST_HEX_LEN]


def write_json_if_absent(path: str, obj: Any) -> bool:
    """Write ``obj`` as JSON to ``path`` atomically (temp file + os.replace via link),
    with the bytes vLLM writes (``json.dump(obj, f, indent=2, sort_keys=True)``).

    Returns True if this call created the file, False if it already existed; OSError
    (errno, ``filename`` = ``path``) if it cannot be written (ENOSPC...).  Concurrent
    writers are safe: the temp file is published with ``os.link`` (fails with EEXIST if
    another writer won), so an existing file is never overwritten.
    """
    if os.path.exists(path):
        return False
    d = os.path.dirname(path)
    # 0644 (minus umask) like the block files, not mkstemp's 0600: the cache is shared by
    # other ranks, replicas and users
    tmp = os.path.join(d, f"{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    try:
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # ENOSPC, EIO...: name the file (a failed write has none), one error
            raise OSError(e.errno, e.strerror, path) from None
        try:
            os.link(tmp, path)  # atomic and never replaces an existing file
            return True
        except FileExistsError:
            return False
        except OSError:
            # filesystems without hard links: replace, after re-checking absence
            if os.path.exists(path):
                return False
            os.replace(tmp, path)
            return True
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


class FileMapper:
    """Maps block keys ``(hash: bytes, group_idx: int)`` to file paths under ``root_dir``.

    Arguments are vLLM 0.33's (``FileMapper.__init__``): the hashed fields (module
    docstring) plus ``root_dir`` and ``rank``.  ``parallel_agnostic=True`` forces
    tp/pp/pcp/dcp to 1 and rank to 0 (as vLLM) so different parallel layouts share one
    directory; ``False`` adds ``"parallel_agnostic": false`` to the hashed fields.
    (vLLM's ``from_offloading_spec`` passes ``parallel_agnostic`` only when the layout
    really is parallel-agnostic: pass the effective value here.)

    Raises TypeError for a wrong argument type and ValueError for a bad value
    (non-positive sizes, rank outside ``[0, tp_size * pp_size * pcp_size)``, ``dcp_size``
    not dividing ``tp_size``, empty model name).
    """

    def __init__(
        self,
        root_dir: "str | os.PathLike",
        model_name: str,
        tokens_per_hash: int = 16,
        blocks_per_file: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        pcp_size: int = 1,
        dcp_size: int = 1,
        rank: int = 0,
        dtype: Any = "bfloat16",
        kv_cache_groups: Optional[Sequence[Mapping]] = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        replicated_layout: bool = False,
        canonical_format: Optional[str] = None,
    ) -> None:
        root = check_root_dir(root_dir)
        if not isinstance(model_name, str):
            raise TypeError(f"model_name must be a str, got {type(model_name).__name__}")
        if not model_name:
            raise ValueError("model_name must not be empty")
        if "\0" in model_name:
            raise ValueError(f"model_name must not contain a NUL byte: {model_name!r}")
        if not isinstance(inference_engine, str) or not inference_engine:
            raise TypeError("inference_engine must be a non-empty str")
        _check_int("tokens_per_hash", tokens_per_hash, 1)
        _check_int("blocks_per_file", blocks_per_file, 1)
        for n, v in (("parallel_agnostic", parallel_agnostic), ("replicated_layout", replicated_layout)):
            if not isinstance(v, bool):
                raise TypeError(f"{n} must be a bool, got {type(v).__name__}")
        if canonical_format is not None and (not isinstance(canonical_format, str) or not canonical_format):
            raise TypeError(f"canonical_format must be a non-empty str or None, got {canonical_format!r}")
        for n, v in (("tp_size", tp_size), ("pp_size", pp_size), ("pcp_size", pcp_size), ("dcp_size", dcp_size)):
            _check_int(n, v, 1)
        _check_int("rank", rank, 0)
        if parallel_agnostic:
            tp_size = pp_size = pcp_size = dcp_size = 1
            rank = 0
        if tp_size % dcp_size:
            raise ValueError(f"dcp_size ({dcp_size}) must divide tp_size ({tp_size})")
        world = tp_size * pp_size * pcp_size
        if rank >= world:
            raise ValueError(f"rank {rank} out of range for world size {world} (tp*pp*pcp)")
        self.root_dir: str = root
        self.rank: int = rank
        self.fields: dict = {
            "model_name": model_name,
            "tokens_per_hash": tokens_per_hash,
            "blocks_per_file": blocks_per_file,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "pcp_size": pcp_size,
            "dcp_size": dcp_size,
            "dtype": dtype_name(dtype),
            "kv_cache_groups": _check_groups(kv_cache_groups),
            "inference_engine": inference_engine,
        }
        if not parallel_agnostic:
            self.fields["parallel_agnostic"] = False
        if replicated_layout:
            self.fields["replicated_layout"] = True
        if canonical_format is not None:
            self.fields["canonical_format"] = canonical_format
        self.digest: str = fields_digest(self.fields)
        #: ``<root>/<model>_<digest>``: holds config.json (a plain f-string, as vLLM's)
        self.base_path: str = f"{root}/{model_name.replace('/', '_')}_{self.digest}"
        #: ``<root>/<model>_<digest>_r<rank>``: holds this rank's block files
        self.rank_path: str = f"{self.base_path}_r{rank}"

    @property
    def config_path(self) -> str:
        """``<base_path>/config.json``."""
        return f"{self.base_path}/{CONFIG_FILENAME}"

    @staticmethod
    def check_key(key: Any) -> Key:
        """Validate a key: a 2-tuple ``(bytes, int)``; non-empty hash, group >= 0.

        Raises TypeError / ValueError.
        """
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"a key is a tuple (block_hash: bytes, group_idx: int), got {key!r}")
        h, g = key
        if not isinstance(h, (bytes, bytearray, memoryview)):
            raise TypeError(f"block hash must be bytes, got {type(h).__name__}")
        if len(h) == 0:
            raise ValueError("block hash must not be empty")
        _check_int("group_idx", g, 0)
        return bytes(h), g

    def get_file_name(self, key: Key) -> str:
        """Path of the block file for ``key``: ``<base>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``."""
        return self._file_name(*self.check_key(key))

    def _file_name(self, h: bytes, g: int) -> str:
        """:meth:`get_file_name` of a key already through :meth:`check_key`."""
        hx = h.hex()
        return f"{self.rank_path}/{hx[:3]}/{hx[3:5]}_g{g}/{hx}.bin"

    def get_file_names(self, keys: Sequence[Key]) -> list:
        """:meth:`get_file_name` for each key (validates every key first)."""
        return [self.get_file_name(k) for k in keys]

    def write_run_config(self) -> bool:
        """Create ``base_path`` and write ``config.json`` (fields, indent 2, sorted keys, as
        vLLM) atomically, only if absent.  Returns True if written.  Raises OSError."""
        os.makedirs(self.base_path, exist_ok=True)
        return write_json_if_absent(self.config_path, self.fields)

    def read_block_info(self) -> Optional[dict]:
        """Contents of ``kvtier.json`` or None if absent (OSError / ValueError if unreadable)."""
        return read_block_info(self.base_path)

    def write_block_info(self, block_bytes: int) -> bool:
        """:func:`write_block_info` into this mapper's ``base_path``."""
        return write_block_info(self.base_path, block_bytes)

    def __repr__(self) -> str:
        return f"FileMapper(rank_path={self.rank_path!r}, fields={self.fields!r})"


def read_block_info(base_path: str) -> Optional[dict]:
    """Contents of ``<base_path>/kvtier.json``, or None if absent.  ValueError naming the
    file if it is not JSON (e.g. empty, or garbage after a crash of another writer)."""
    path = f"{base_path}/{BLOCK_INFO_FILENAME}"
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e}): it records the tier's block size; remove it "
                         f"to have it written again") from None


def root_block_sizes(root: str) -> "dict[str, int]":
    """``{layout directory name: block_bytes}`` for each ``<model>_<digest>`` directory of
    ``root`` whose ``kvtier.json`` records a block size (one listing of ``root``, one open per
    directory in it).  A layout without the file (vLLM's ``"fs"`` tier writes none), or with
    one that is unreadable or not JSON, is left out; OSError when ``root`` cannot be listed."""
    out = {}
    with os.scandir(root) as it:
        dirs = sorted(e.name for e in it if e.is_dir())
    for name in dirs:
        try:
            v = (read_block_info(os.path.join(root, name)) or {}).get("block_bytes")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[name] = v
    return out


def write_block_info(base_path: str, block_bytes: int) -> bool:
    """Record ``{"block_bytes": N}`` in ``<base_path>/kvtier.json`` (kvtier-only, not
    hashed; atomically, only if absent).  Returns True if written.

    Raises ValueError if the file exists with a different block size: the files in
    this directory were written with another block geometry.
    """
    _check_int("block_bytes", block_bytes, 1)
    os.makedirs(base_path, exist_ok=True)
    path = f"{base_path}/{BLOCK_INFO_FILENAME}"
    if write_json_if_absent(path, {"block_bytes": block_bytes}):
        return True
    have = (read_block_info(base_path) or {}).get("block_bytes")
    if have != block_bytes:
        raise ValueError(
            f"{path} records block_bytes={have}, but this tier uses {block_bytes}-byte blocks; "
            f"the same FileMapper fields must give the same block size"
        )
    return False
