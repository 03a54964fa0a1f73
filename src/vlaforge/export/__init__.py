"""Export, floor 10 (imports `evaluation` and below): `vlaforge export --format onnx|executorch` writes a policy
package (manifest, tokenizer, ONNX graphs in fp32, fp16 or int8 QDQ, or ExecuTorch programs) and measures it against
its checkpoint through `PolicyRuntime`. The package's reader is the runtime's package backend
(`inference/packages.py`)."""
