"""Extensions of the Pallas Triton lowering: the one module of the package that imports jax._src.

`inline_asm_multi` is `plgpu.elementwise_inline_asm` with several results (JAX 0.10's rule returns
them as one value): a primitive of this package lowered through the Triton lowering's registry.
"""

from __future__ import annotations

import jax.numpy as jnp

_asm_multi_p = None


def inline_asm_multi(asm, args, constraints, n_out, dtype):
    """Elementwise inline PTX `asm` over same-shaped args -> n_out arrays of `dtype` (bf16, f16 or f32),
    `constraints` as in `plgpu.elementwise_inline_asm` (outputs first), one element a lane."""
    global _asm_multi_p
    if _asm_multi_p is None:
        from jax._src import core as jax_core
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as tl

        prim = jax_core.Primitive("eagle3_elementwise_inline_asm")
        prim.multiple_results = True
        prim.def_abstract_eval(lambda *avals, asm, constraints, n_out, dtype: [
            jax_core.ShapedArray(avals[0].shape, dtype) for _ in range(n_out)])
        elt = {jnp.dtype(jnp.bfloat16): ir.BF16Type.get, jnp.dtype(jnp.float16): ir.F16Type.get,
               jnp.dtype(jnp.float32): ir.F32Type.get}

        def rule(ctx, *vals, asm, constraints, n_out, dtype):
            shape = ir.RankedTensorType(vals[0].type).shape
            types = [ir.RankedTensorType.get(shape, elt[jnp.dtype(dtype)]()) for _ in range(n_out)]
            res = tt_dialect.elementwise_inline_asm(types, asm, constraints=constraints, pure=True,
                                                    packed_element=1, args=list(vals))
            return list(res) if n_out > 1 else [res]

        tl.register_lowering(prim)(rule)
        _asm_multi_p = prim
    return _asm_multi_p.bind(*args, asm=asm, constraints=constraints, n_out=n_out, dtype=jnp.dtype(dtype))
