"""Run by tests/test_pallas_allreduce.py in a subprocess with 4 CPU devices: the target's decode-sized
trunk on (data 1, model 2) and (data 2, model 2) meshes, with the fused all-reduce kernel chosen
(KernelPolicy's tp_reduce and tp_pick forced: this machine has no GPU) and a Mailbox in the run context,
lowered for CUDA. There must be one kernel call for the embedding lookup and one a sublayer (two a
layer), none reading XLA's collective metadata (device ids, peer refs: XLA would launch a barrier
before each call); the greedy pick over the vocabulary split over "model" (`parallel.vocab_argmax`)
one call and no collective. Each device's Mailbox must hold its index along "model" and its model
group's inbox addresses in group order. Prints "ok"."""

import os
import re

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from eagle3_jax import parallel  # noqa: E402
from eagle3_jax.models import GptOssConfig, gpt_oss  # noqa: E402
from eagle3_jax.pallas import allreduce  # noqa: E402
from eagle3_jax.pallas.select import KernelPolicy  # noqa: E402

FUSED = KernelPolicy(tp_reduce="kernel", tp_pick="kernel")  # the one-shot kernel wherever a Mailbox is


def check_table(mesh, mailbox):
    """Device (d, m)'s rank is m, rows 0 .. M - 1 of its table are its group's inboxes, each the
    address that member itself holds at its own rank, row M its own calls counter and the last row its
    own failure record."""
    table = {s.device: np.asarray(s.data).view(np.uint32).astype(np.int64) for s in mailbox.table.addressable_shards}
    rank = {s.device: int(np.asarray(s.data)[0, 0]) for s in mailbox.rank.addressable_shards}
    address = {dev: [int(lo) | (int(hi) << 32) for lo, hi in table[dev]] for dev in table}
    M = mesh.shape["model"]
    inbox_bytes = 2 * M * allreduce.MAX_ROWS * 2 * allreduce.row_width(mailbox) * 4
    for (d, m), dev in np.ndenumerate(mesh.devices):
        assert rank[dev] == m, (dev, rank[dev], m)
        want = [address[mesh.devices[d, k]][k] for k in range(M)]
        assert address[dev][:-2] == want, (dev, address[dev], want)
        assert address[dev][-2] == address[dev][m] + inbox_bytes  # its calls counter, after its inbox
    assert len({address[dev][rank[dev]] for dev in table}) == mesh.size  # each device its own memory
    assert len({address[dev][-1] for dev in table}) == mesh.size  # and its own failure record


def main():
    cfg = GptOssConfig.preset("tiny")
    for data, model in ((1, 2), (2, 2)):
        mesh = parallel.make_mesh(model=model, data=data, devices=jax.devices()[:data * model])
        target = parallel.shard(gpt_oss.GptOss(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh)
        graphdef, params = nnx.split(target)
        mailbox = allreduce.new_mailbox(mesh, cfg.hidden_size)
        check_table(mesh, mailbox)

        def trunk(params, ctx, tokens, lengths):
            return gpt_oss.run_layers(nnx.merge(graphdef, params), tokens, tokens, lengths, None, None, ctx=ctx)[0]

        ctx = parallel.RunContext(mesh=mesh, kernels=FUSED, mailbox=mailbox)

        rows = NamedSharding(mesh, P("data"))
        tokens = jax.device_put(jnp.zeros((2 * data, 3), jnp.int32), rows)
        lengths = jax.device_put(jnp.zeros((2 * data,), jnp.int32), rows)
        text = jax.jit(trunk).trace(params, ctx, tokens, lengths).lower(lowering_platforms=("cuda",)).as_text()
        uses = re.findall(r"uses_xla_collective_metadata = (\w+)", text)
        # the embedding lookup's sum, then two a layer
        assert uses == ["false"] * (2 * cfg.num_hidden_layers + 1), (data, model, uses)

        def pick(ctx, logits):
            return parallel.vocab_argmax(ctx, logits)

        logits = jax.device_put(jnp.zeros((2 * data, 4, cfg.vocab_size), jnp.float32),
                                NamedSharding(mesh, P("data", None, "model")))
        text = jax.jit(pick).trace(ctx, logits).lower(lowering_platforms=("cuda",)).as_text()
        # the greedy pick exchanges each device's best through one kernel call, no XLA collective
        assert re.findall(r"uses_xla_collective_metadata = (\w+)", text) == ["false"], (data, model)
        assert not re.search(r"all_reduce|all_gather", text), (data, model)
    mesh = parallel.make_mesh(model=4, data=1, devices=jax.devices()[:4])
    check_table(mesh, allreduce.new_mailbox(mesh, cfg.hidden_size))
    print("ok")


if __name__ == "__main__":
    main()
