"""Seeded fuzzing of the checkpoint loaders (issue 66): 300 copies of a tiny GPT-OSS checkpoint (two
shards and an index) and of a tiny EAGLE-3 draft, each with one random fault: in a safetensors file
(cut short, its header's length, bytes or JSON garbled, an entry's dtype, shape or data_offsets
changed, an entry dropped, renamed or doubled, bytes appended, an MXFP4 scale set to 255, E8M0's
NaN), in the index, or in config.json (text garbled, a key dropped or given a value of another type
or range). Each load must either raise ValueError naming the case's folder (and the key at fault
where the fault has one), or return exactly the weights safetensors' own reader reads from the
files (config.json and index faults: the clean weights): never another exception, never other
weights. Floating weights are data: NaN in one loads as NaN (the oracle compares bits)."""

import json
import os
import shutil
import struct

import numpy as np
import pytest
import safetensors.numpy
from eagle3_reference_np import write_random_draft
from flax import nnx
from hf_fixtures import random_hf_weights, tiny_hf_config, write_hf_checkpoint, write_safetensors

from eagle3_jax.convert import load_eagle3, load_gpt_oss

INDEX = "model.safetensors.index.json"
ODD_VALUES = ["64", "", [], [64], {}, {"a": 1}, None, True, False, 1.5, -1, 0, 10 ** 30, float("nan"),
              float("inf"), "gpt_oss", [0, 1, 1], "sliding_attention"]
INTS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
        "max_position_embeddings", "target_hidden_size", "draft_vocab_size"}
NUMBERS = {"rms_norm_eps", "swiglu_limit", "rope_theta"}
BOOLS = {"attention_bias", "tie_word_embeddings"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """(root, target, draft): the clean checkpoints root/target (2 shards + index) and root/draft,
    and the models they load as."""
    root = tmp_path_factory.mktemp("fuzz")
    cfg = tiny_hf_config(num_hidden_layers=2)
    write_hf_checkpoint(root / "target", cfg, random_hf_weights(cfg, 5), num_shards=2)
    write_random_draft(root / "draft", 6, vocab_size=128, target_hidden_size=64, aux_layer_ids=(0, 1, 1))
    target = load_gpt_oss(root / "target", progress=False)
    return root, target, load_eagle3(root / "draft", target=target, progress=False)


def flat(model) -> dict:
    return {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model))}


def differences(x, y) -> list:
    fx, fy = flat(x), flat(y)
    if fx.keys() != fy.keys():
        return sorted(set(fx) ^ set(fy))
    return [k for k in fx if fx[k].dtype != fy[k].dtype or fx[k].shape != fy[k].shape
            or not np.array_equal(fx[k].view(np.uint8), fy[k].view(np.uint8))]


# -- one fault a case: each returns (description, strings one of which the error must name or None) --

def _split(data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header, body: bytes, raw: bytes | None = None) -> bytes:
    raw = json.dumps(header).encode() if raw is None else raw
    return struct.pack("<Q", len(raw)) + raw + body


def _odd_shape(rng, shape):
    shape = list(shape)
    choices = [shape[:-1], shape + [1], [int(np.prod(shape))], shape[::-1], [-1] + shape[1:], [2.0] * len(shape),
               ["4"], None, 7, [10 ** 30], [True] * len(shape), [d + 1 for d in shape]]
    return choices[rng.integers(len(choices))]


def _odd_offsets(rng, offsets, size):
    s, e = offsets
    choices = [[s + 1, e + 1], [s - 1, e - 1], [s, e + 8], [s, size + 100], [-8, e], [e, s], [s], [s, e, e],
               [float(s), float(e)], "0", None, [s, 10 ** 20], [0, e - s]]
    return choices[rng.integers(len(choices))]


def fault_in_safetensors(rng, file: str):
    """One random fault in a .safetensors file; (description, key names the error may give or None)."""
    data = open(file, "rb").read()
    header, body = _split(data)
    n = len(data) - len(body) - 8
    keys = [k for k in header if k != "__metadata__"]
    key = keys[rng.integers(len(keys))]
    kind = ["truncate", "length", "garble", "json_cut", "not_object", "dup_key", "metadata", "dtype", "dtype",
            "shape", "shape", "offsets", "offsets", "delete", "rename", "trailing", "scale255", "data"][
        rng.integers(18)]
    names = None
    if kind == "truncate":
        out = data[:rng.integers(0, len(data))]
    elif kind == "length":
        out = struct.pack("<Q", int([0, 1, 7, n - 1, n + 1, len(data), 2 ** 63, rng.integers(1 << 40)][
            rng.integers(8)])) + data[8:]
    elif kind == "garble":
        out = bytearray(data)
        for i in rng.integers(8, 8 + n, rng.integers(1, 4)):
            out[i] = int(rng.integers(256))
        out = bytes(out)
    elif kind == "json_cut":
        raw = data[8:8 + n]
        cut = int(rng.integers(0, n))
        out = data[:8] + raw[:cut] + b" " * (n - cut) + body
    elif kind == "not_object":
        out = _join(None, body, [b"[]", b"1", b'"x"', b"null", b"[" * 100000][rng.integers(5)])
    elif kind == "dup_key":
        raw = json.dumps(header)
        entry = json.dumps({key: header[key]})[1:-1]
        out = _join(None, body, ("{" + entry + ", " + raw[1:]).encode())
        names = [key]
    elif kind == "metadata":
        header["__metadata__"] = [{"format": 1}, [], "pt", {"a": None}][rng.integers(4)]
        out = _join(header, body)
        names = ["__metadata__"]
    elif kind == "dtype":
        header[key]["dtype"] = ["F32", "F16", "BF16", "U8", "I8", "I32", "I64", "BOOL", "F64", "F8_E4M3", "bf16",
                                "", 3, None, ["F32"]][rng.integers(15)]
        out = _join(header, body)
        names = [key]
    elif kind == "shape":
        header[key]["shape"] = _odd_shape(rng, header[key]["shape"])
        out = _join(header, body)
        names = [key]
    elif kind == "offsets":
        header[key]["data_offsets"] = _odd_offsets(rng, header[key]["data_offsets"], len(body))
        out = _join(header, body)
        names = keys  # the entry at fault or the one it now overlaps
    elif kind == "delete":
        del header[key]
        out = _join(header, body)
    elif kind == "rename":
        header[key + ["x", ".weight", "_blocks"][rng.integers(3)]] = header.pop(key)
        out = _join(header, body)
        names = [key]
    elif kind == "trailing":
        out = data + bytes(rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8))
    elif kind == "scale255":
        scales = [k for k in keys if k.endswith("_scales")]
        if not scales:
            return fault_in_safetensors(rng, file)
        key = scales[rng.integers(len(scales))]
        s, e = header[key]["data_offsets"]
        body = bytearray(body)
        body[int(rng.integers(s, e))] = 255
        out = _join(header, bytes(body))
        names = [key]
    else:  # data: other bytes, same layout (any float bits are weights; the oracle compares them)
        s, e = header[key]["data_offsets"]
        body = bytearray(body)
        if e > s:
            body[int(rng.integers(s, e))] ^= 0x5A
        out = _join(header, bytes(body))
    with open(file, "wb") as f:
        f.write(out)
    return f"{os.path.basename(file)}: {kind} {key}", names


def fault_in_config(rng, file: str):
    """One random fault in a config.json; (description, key names the error must give or None)."""
    text = open(file).read()
    cfg = json.loads(text)
    kind = ["text", "delete", "value", "value", "value", "rope", "eagle"][rng.integers(7)]
    names = None
    if kind == "text":
        cut = int(rng.integers(0, len(text)))
        out = [text[:cut], "[]", "", "\xff\xfe", text.replace(":", ";", 1), "null", "[" * 100000][rng.integers(7)]
        desc = f"config.json text {out[:20]!r}"
    else:
        if kind == "rope" and isinstance(cfg.get("rope_scaling"), dict):
            parent, prefix = cfg["rope_scaling"], "rope_scaling"
        elif kind == "eagle" and isinstance(cfg.get("eagle_config"), dict):
            parent, prefix = cfg["eagle_config"], "eagle_config"
        else:
            parent, prefix = cfg, ""
        key = sorted(parent)[rng.integers(len(parent))] if parent else "hidden_size"
        if kind == "delete":
            parent.pop(key, None)
            desc = f"config.json: no {prefix}.{key}"
        else:
            value = ODD_VALUES[rng.integers(len(ODD_VALUES))]
            parent[key] = value
            desc = f"config.json: {prefix}.{key} = {value!r}"
            wrong = ((key in INTS and type(value) is not int) or (key in NUMBERS and type(value) not in (int, float))
                     or (key in BOOLS and type(value) is not bool))
            if wrong and value is not None and prefix != "eagle_config":
                names = [key]
        out = json.dumps(cfg)
    with open(file, "w") as f:
        f.write(out)
    return desc, names


def fault_in_index(rng, folder: str):
    file = os.path.join(folder, INDEX)
    index = json.load(open(file))
    wm = index["weight_map"]
    key = sorted(wm)[rng.integers(len(wm))]
    shards = sorted(set(wm.values()))
    kind = ["other_shard", "missing_file", "path", "type", "drop", "extra", "weight_map", "text", "stray"][
        rng.integers(9)]
    names = [key]
    if kind == "other_shard":
        wm[key] = next(s for s in shards if s != wm[key])
    elif kind == "missing_file":
        wm[key] = "model-00009-of-00009.safetensors"
        names = ["model-00009-of-00009.safetensors"]
    elif kind == "path":
        wm[key] = ["../target/" + wm[key], "/etc/passwd", "sub/x.safetensors", "."][rng.integers(4)]
    elif kind == "type":
        wm[key] = [3, None, [wm[key]], {"f": 1}][rng.integers(4)]
    elif kind == "drop":
        del wm[key]
    elif kind == "extra":
        wm["model.layers.9.mlp.router.weight"] = shards[0]
        names = ["model.layers.9.mlp.router.weight"]
    elif kind == "weight_map":
        index["weight_map"] = [[], "x", None, 3][rng.integers(4)]
        names = [INDEX]
    if kind == "text":
        open(file, "w").write(["{", "[]", "", "null", '{"weight_map": '][rng.integers(5)])
        names = [INDEX]
    elif kind == "stray":
        shutil.copy(os.path.join(folder, shards[0]), os.path.join(folder, "model.safetensors"))
        names = ["model.safetensors"]
    else:
        json.dump(index, open(file, "w"))
    return f"{INDEX}: {kind} {key}", names


# -- the oracle ---------------------------------------------------------------------------------

def _reference_copy(case: str, dest: str) -> None:
    """The case's tensors as safetensors' own reader reads them, rewritten plainly in `dest` beside
    the case's config.json and index (raises whatever that reader raises)."""
    shutil.copytree(case, dest, ignore=lambda d, names: [n for n in names if n.endswith(".safetensors")])
    if os.path.exists(os.path.join(case, INDEX)):
        files = sorted(set(json.load(open(os.path.join(case, INDEX)))["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(case) if f.endswith(".safetensors"))
    for f in files:
        write_safetensors(os.path.join(dest, f), safetensors.numpy.load_file(os.path.join(case, f)))


def check_case(case: str, load, clean, desc: str, names, weights_may_change: bool) -> str | None:
    """None when the case behaves as promised, else what went wrong."""
    try:
        model = load(case)
    except ValueError as e:
        msg = str(e)
        if case not in msg:
            return f"{desc}: the error does not name the file: {msg}"
        if names is not None and not any(k in msg for k in names):
            return f"{desc}: the error names none of {names[:3]}: {msg}"
        return None
    except Exception as e:  # noqa: BLE001 (what the test looks for)
        return f"{desc}: {type(e).__name__} escaped: {e}"
    if not weights_may_change:
        diff = differences(model, clean)
        return f"{desc}: loaded other weights: {diff[:3]}" if diff else None
    try:
        _reference_copy(case, case + ".reference")
    except Exception as e:  # noqa: BLE001
        return f"{desc}: loaded a file safetensors' reader rejects ({type(e).__name__}: {e})"
    diff = differences(model, load(case + ".reference"))
    return f"{desc}: weights differ from safetensors' reading: {diff[:3]}" if diff else None


def run_cases(tmp_path, source, n, seed, fault, load, clean, weights_may_change):
    rng = np.random.default_rng(seed)
    failures = []
    for i in range(n):
        case = str(tmp_path / f"case{i}")
        shutil.copytree(source, case)
        desc, names = fault(rng, case)
        problem = check_case(case, load, clean, f"case {i}, {desc}", names, weights_may_change)
        if problem:
            failures.append(problem)
    assert not failures, f"{len(failures)} of {n} cases:\n" + "\n".join(failures[:12])


def _a_shard(rng, case):
    shards = sorted(f for f in os.listdir(case) if f.endswith(".safetensors"))
    return fault_in_safetensors(rng, os.path.join(case, shards[rng.integers(len(shards))]))


def test_gpt_oss_safetensors_faults(bases, tmp_path):
    root, target, _ = bases
    run_cases(tmp_path, root / "target", 110, 1, _a_shard, lambda p: load_gpt_oss(p, progress=False), target, True)


def test_gpt_oss_index_faults(bases, tmp_path):
    root, target, _ = bases
    run_cases(tmp_path, root / "target", 30, 2, fault_in_index, lambda p: load_gpt_oss(p, progress=False), target,
              False)


def test_gpt_oss_config_faults(bases, tmp_path):
    root, target, _ = bases
    run_cases(tmp_path, root / "target", 60, 3, lambda rng, c: fault_in_config(rng, os.path.join(c, "config.json")),
              lambda p: load_gpt_oss(p, progress=False), target, False)


def test_eagle3_safetensors_faults(bases, tmp_path):
    root, target, draft = bases
    run_cases(tmp_path, root / "draft", 50, 4, _a_shard,
              lambda p: load_eagle3(p, target=target, progress=False), draft, True)


def test_eagle3_config_faults(bases, tmp_path):
    root, target, draft = bases
    run_cases(tmp_path, root / "draft", 50, 5, lambda rng, c: fault_in_config(rng, os.path.join(c, "config.json")),
              lambda p: load_eagle3(p, target=target, progress=False), draft, False)
