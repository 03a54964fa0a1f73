"""Export, floor 10 (imports `evaluation` and below): `vlaforge export --format onnx` writes a policy package
(manifest, tokenizer, ONNX graphs; fp32, fp16 or int8 QDQ) and measures it against its checkpoint through
`PolicyRuntime`. The package's reader is the runtime's ONNX backend (`inference/onnx_backend.py`)."""
