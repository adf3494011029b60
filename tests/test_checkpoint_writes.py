"""Checkpoint writers write whole folders or nothing, refuse to mix checkpoints, check what they write;
loaders refuse ambiguous folders and say which config.json defaults they assumed (issue 66).

Tiny checkpoints from the numpy fixtures (hf_fixtures, eagle3_reference_np): nothing here compiles
a model. The kill test runs its trials in processes forked by checkpoint_kill_worker.py."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eagle3_reference_np import write_random_draft
from experiment_runner import cpu_env, execute, fails
from flax import nnx
from hf_fixtures import random_hf_weights, tiny_hf_config, write_hf_checkpoint

from eagle3_jax.convert import (
    folders,
    load_eagle3,
    load_gpt_oss,
    restore_checkpoint,
    save_checkpoint,
    save_eagle3,
    save_gpt_oss,
)
from eagle3_jax.train import loop

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_kill_worker.py")
SMALL_SHARDS = 40_000  # bytes: the tiny target in several shards and an index


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target A, target B, draft) loaded from fixture checkpoints (2-layer tiny target, a draft for it)."""
    root = tmp_path_factory.mktemp("sources")
    cfg = tiny_hf_config(num_hidden_layers=2)
    for name, seed in (("a", 1), ("b", 2)):
        write_hf_checkpoint(root / name, cfg, random_hf_weights(cfg, seed))
    write_random_draft(root / "draft", 3, vocab_size=128, target_hidden_size=64, aux_layer_ids=(0, 1, 1))
    a, b = load_gpt_oss(root / "a", progress=False), load_gpt_oss(root / "b", progress=False)
    return a, b, load_eagle3(root / "draft", target=a, progress=False)


def flat(model) -> dict:
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model))}


def same(x, y) -> bool:
    fx, fy = flat(x), flat(y)
    return fx.keys() == fy.keys() and all(fx[k].dtype == fy[k].dtype and np.array_equal(fx[k], fy[k]) for k in fx)


def listing(path) -> list:
    return sorted(os.listdir(path))


def test_saving_over_a_checkpoint_needs_overwrite_and_leaves_no_stale_shard(pair, tmp_path):
    a, b, _ = pair
    d = tmp_path / "ckpt"
    save_gpt_oss(a, d, max_shard_bytes=SMALL_SHARDS)
    assert "model.safetensors.index.json" in listing(d) and len(listing(d)) > 3
    before = {f: (d / f).read_bytes() for f in listing(d)}
    with pytest.raises(ValueError, match=rf"save_gpt_oss: {d} is not empty: it holds a GPT-OSS checkpoint "
                                         r"\(config\.json, model\.safetensors\.index\.json, \d+ \*\.safetensors "
                                         r"files\); pass overwrite=True"):
        save_gpt_oss(b, d)
    assert {f: (d / f).read_bytes() for f in listing(d)} == before
    save_gpt_oss(b, d, overwrite=True)
    assert listing(d) == ["config.json", "model.safetensors"]
    assert same(load_gpt_oss(d, progress=False), b)
    assert [e for e in listing(tmp_path) if e != "ckpt"] == []  # no temporary folder left


def test_overwrite_keeps_other_files(pair, tmp_path):
    """What a user keeps beside the weights (a README, the tokenizer) survives overwrite=True; a file of
    the same name the writer writes is the writer's."""
    a, b, _ = pair
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "README.md").write_text("notes")
    with pytest.raises(ValueError, match=r"is not empty: it holds README\.md; pass overwrite=True"):
        save_gpt_oss(a, d)
    (d / "tokenizer.json").write_text("{}")
    (d / "extra").mkdir()
    (d / "extra" / "x.txt").write_text("x")
    save_gpt_oss(a, d, overwrite=True, max_shard_bytes=SMALL_SHARDS)
    save_gpt_oss(b, d, overwrite=True)
    assert listing(d) == ["README.md", "config.json", "extra", "model.safetensors", "tokenizer.json"]
    assert (d / "README.md").read_text() == "notes" and (d / "extra" / "x.txt").read_text() == "x"
    assert same(load_gpt_oss(d, progress=False), b)


def test_fallback_replacement_without_exchange(pair, tmp_path, monkeypatch):
    """Where the atomic exchange is not offered: old folder aside, new one renamed in, old one deleted."""
    a, b, _ = pair
    d = tmp_path / "ckpt"
    save_gpt_oss(a, d, max_shard_bytes=SMALL_SHARDS)
    monkeypatch.setattr(folders, "_exchange", lambda x, y: False)
    save_gpt_oss(b, d, overwrite=True)
    assert listing(tmp_path) == ["ckpt"] and listing(d) == ["config.json", "model.safetensors"]
    assert same(load_gpt_oss(d, progress=False), b)


def test_a_failed_save_changes_nothing(pair, tmp_path, monkeypatch):
    a, b, _ = pair
    d = tmp_path / "ckpt"
    save_gpt_oss(a, d, max_shard_bytes=SMALL_SHARDS)
    before = {f: (d / f).read_bytes() for f in listing(d)}
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    import safetensors.numpy
    real = safetensors.numpy.save_file
    monkeypatch.setattr(safetensors.numpy, "save_file", failing)
    with pytest.raises(OSError, match="No space left"):
        save_gpt_oss(b, d, overwrite=True, max_shard_bytes=SMALL_SHARDS)
    assert {f: (d / f).read_bytes() for f in listing(d)} == before
    assert listing(tmp_path) == ["ckpt"]


def test_folders_that_cannot_be_replaced(pair, tmp_path, monkeypatch):
    a, _, _ = pair
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"save_gpt_oss: .*file is a file, expected a folder"):
        save_gpt_oss(a, tmp_path / "file")
    mount = tmp_path / "mnt"
    mount.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == str(mount))
    with pytest.raises(ValueError, match=r"save_gpt_oss: .*mnt is a mount point, .* write into a folder inside it"):
        save_gpt_oss(a, mount, overwrite=True)
    save_gpt_oss(a, mount / "ckpt")
    assert listing(tmp_path) == ["file", "mnt"] and listing(mount) == ["ckpt"]


def test_writers_check_the_model_first(pair, tmp_path):
    a, _, draft = pair
    with pytest.raises(ValueError, match="^save_gpt_oss: expected a GptOss model, got Eagle3$"):
        save_gpt_oss(draft, tmp_path / "t")
    with pytest.raises(ValueError, match="^save_eagle3: expected an Eagle3 model, got GptOss$"):
        save_eagle3(a, tmp_path / "d")
    with pytest.raises(ValueError, match="^save_checkpoint: expected a GptOss model, got Eagle3$"):
        save_checkpoint(draft, tmp_path / "o")
    assert listing(tmp_path) == []  # no folder made


def test_writers_never_touch_a_checkpoint_of_another_kind(pair, tmp_path):
    a, _, draft = pair
    target, orbax = tmp_path / "target", tmp_path / "orbax"
    save_gpt_oss(a, target)
    save_checkpoint(a, orbax)
    files = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(ValueError, match=rf"save_eagle3: {target} is not empty: it holds a GPT-OSS checkpoint"):
        save_eagle3(draft, target)
    with pytest.raises(ValueError, match=r"save_checkpoint: expected a GptOss model, got Eagle3"):
        save_checkpoint(draft, orbax, overwrite=True)  # the kind of model first, whatever overwrite says
    with pytest.raises(ValueError, match=rf"save_gpt_oss: {orbax} is not empty: it holds an orbax checkpoint of a "
                                         r"GPT-OSS \(eagle3_jax\.json, state\)"):
        save_gpt_oss(a, orbax)
    with pytest.raises(ValueError, match=r"ckpt_dir .*target: holds a GPT-OSS checkpoint .* not training checkpoints"):
        loop.fit(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), lambda m, b: (0.0, {}), lambda s: {}, steps=1,
                 tx=loop.adamw(1e-3, 1, 0), ckpt_dir=str(target), progress=False)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == files
    assert same(restore_checkpoint(orbax), a)
    # overwrite=True is the user asking for the replacement: the draft's files only, nothing of the target's
    save_eagle3(draft, target, overwrite=True)
    assert listing(target) == ["config.json", "model.safetensors"]
    assert same(load_eagle3(target, target=a, progress=False), draft)
    save_gpt_oss(a, orbax, overwrite=True)  # the orbax state goes with the other checkpoint files
    assert listing(orbax) == ["config.json", "model.safetensors"]


def test_loader_refuses_an_index_beside_an_unindexed_weights_file(pair, tmp_path):
    a, b, _ = pair
    save_gpt_oss(a, tmp_path / "sharded", max_shard_bytes=SMALL_SHARDS)
    save_gpt_oss(b, tmp_path / "one")
    shutil.copy(tmp_path / "one" / "model.safetensors", tmp_path / "sharded")  # what the old writer left
    with pytest.raises(ValueError, match=r"sharded: holds model\.safetensors\.index\.json and model\.safetensors, "
                                         r"which the index does not name"):
        load_gpt_oss(tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    os.remove(tmp_path / "sharded" / "model.safetensors")
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = next(n for n in index["weight_map"].values() if n != index["weight_map"][key])
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{key}: model\.safetensors\.index\.json places it in model-"):
        load_gpt_oss(tmp_path / "sharded")


@pytest.mark.parametrize("key, default", [("num_hidden_layers", 36), ("hidden_size", 2880),
                                          ("num_attention_heads", 64), ("vocab_size", 201088)])
def test_missing_config_key_names_the_default_assumed(tmp_path, key, default):
    cfg = tiny_hf_config(num_hidden_layers=2)
    w = random_hf_weights(cfg, 0)
    del cfg[key]
    if key == "num_hidden_layers":
        del cfg["layer_types"]
    write_hf_checkpoint(tmp_path, cfg, w)
    with pytest.raises(ValueError, match=rf"config\.json has no {key}: assumed gpt-oss-120b's {key}={default} "
                                         r"\(transformers' GptOssConfig defaults\)"):
        load_gpt_oss(tmp_path)


def test_float_dtypes_only(pair, tmp_path):
    a, _, draft = pair
    save_gpt_oss(a, tmp_path / "t")
    save_eagle3(draft, tmp_path / "d")
    with pytest.raises(ValueError, match=r"load_gpt_oss: dtype: expected a floating dtype \(bfloat16, float16, "
                                         r"float32, float64\), found int32"):
        load_gpt_oss(tmp_path / "t", dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"load_eagle3: dtype: expected a floating dtype .* found uint8"):
        load_eagle3(tmp_path / "d", target=a, dtype=np.uint8)


def test_leftover_temporary_folders_are_not_checkpoints(pair, tmp_path):
    a, _, _ = pair
    d = tmp_path / "ckpt"
    save_gpt_oss(a, d)
    for kind in (folders.PARTIAL, folders.PREVIOUS):  # complete copies, as a kill at the last moment leaves them
        left = tmp_path / f".ckpt.{kind}-0123abcd"
        shutil.copytree(d, left)
        with pytest.raises(ValueError, match="an unfinished or replaced checkpoint a writer left behind"):
            load_gpt_oss(left)
    assert same(load_gpt_oss(d, progress=False), a)
    shutil.rmtree(d)  # the instant between the fallback's two renames
    with pytest.raises(ValueError, match=rf"checkpoint folder not found .*; an interrupted save left the previous "
                                         rf"checkpoint in .*\.ckpt\.{folders.PREVIOUS}-0123abcd"):
        load_gpt_oss(d)


def test_kill_during_save(pair, tmp_path):
    """20 saves (B over A, with overwrite=True; every fifth into a fresh folder) killed by SIGKILL at
    random moments: each folder then holds A or B whole, loading bit for bit (or, only for the fallback
    replacement between its two renames, nothing, the previous version beside it), never a mix."""
    a, b, _ = pair
    ref_a, ref_b, root = tmp_path / "a", tmp_path / "b", tmp_path / "trials"
    save_gpt_oss(a, ref_a, max_shard_bytes=SMALL_SHARDS)
    save_gpt_oss(b, ref_b)
    trials = 20
    for i in ["calibrate", *range(trials)]:
        (root / str(i)).mkdir(parents=True)
        if i == "calibrate" or i % 5 != 4:
            shutil.copytree(ref_a, root / str(i) / "ckpt")
    run = execute(WORKER, root, ref_b, trials, 66, env=cpu_env())
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((root / "results.json").read_text())
    assert report["ops"] > 10, report
    outcomes = []
    for t in report["trials"]:
        i = t["trial"]
        d = root / str(i) / "ckpt"
        assert all(folders.is_temporary(e) for e in os.listdir(root / str(i)) if e != "ckpt"), listing(root / str(i))
        if d.exists():
            assert listing(d) in (listing(ref_a), listing(ref_b)), (t, listing(d))
            m = load_gpt_oss(d, progress=False)
            outcome = "A" if same(m, a) else "B" if same(m, b) else None
            assert outcome is not None, t
            assert outcome == "B" or i % 5 != 4, t
        else:
            outcome = "none"
            if i % 5 != 4:  # there was an old checkpoint: only the fallback's instant between renames loses it
                assert not t["exchange"], t
                previous = folders.previous_versions(d)
                assert len(previous) == 1 and same(load_gpt_oss(previous[0], progress=False), a), t
        outcomes.append(outcome)
    killed = [t for t in report["trials"] if t["status"] == 9]
    assert len(killed) >= trials // 2, report
    assert {"A", "B"} <= set(outcomes), (outcomes, report)


def test_orbax_kinds_in_the_meta_file(pair, tmp_path):
    a, _, _ = pair
    save_checkpoint(a, tmp_path / "o")
    meta_file = tmp_path / "o" / "eagle3_jax.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps(dict(meta, kind="eagle3")))
    with pytest.raises(ValueError, match=r"eagle3_jax\.json: kind: 'eagle3', restore_checkpoint reads 'gpt_oss'"):
        restore_checkpoint(tmp_path / "o")
    meta_file.write_text(json.dumps(dict(meta, dtype="int8")))
    with pytest.raises(ValueError, match=r"eagle3_jax\.json: config or dtype: .*found int8"):
        restore_checkpoint(tmp_path / "o")
    meta_file.write_text(json.dumps(dict(meta, config={**meta["config"], "hidden_size": "64"})))
    with pytest.raises(ValueError, match=r"eagle3_jax\.json: config or dtype: .*hidden_size"):
        restore_checkpoint(tmp_path / "o")
    meta_file.write_text("{")
    with pytest.raises(ValueError, match=r"eagle3_jax\.json: not valid JSON"):
        restore_checkpoint(tmp_path / "o")
    assert jax.tree.leaves(nnx.state(a))  # the pair is unchanged by all this


def test_trainers_refuse_a_full_out_dir_before_training(tmp_path):
    """train_target.py / train_draft.py check --out_dir first (hours of training would be lost at the
    end otherwise): here the data folder does not even exist, and the out_dir is what they name."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    for script, more in (("train_target.py", []), ("train_draft.py", ["--target", str(out)])):
        err = fails(script, "--out_dir", str(out), "--data_dir", str(tmp_path / "no_data"), *more)
        assert f"{script} --out_dir: {out} is not empty: it holds a checkpoint (config.json); pass --overwrite to " \
               "replace its checkpoint files" in err, err

