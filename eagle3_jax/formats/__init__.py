"""Data formats shared by the kernels and the models: `mxfp4` (E2M1 nibbles with E8M0 scales, as the
HF checkpoints store the experts), `packed_mask` (bit-packed attention masks of tree verify),
`tokenizer` (tokenizer.json) and `chat` (a checkpoint's chat template, rendered and tokenized as
transformers does). Leaf modules: they import only jax, numpy, tokenizers and jinja2."""
