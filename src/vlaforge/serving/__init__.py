"""Serving, floor 8 (imports `inference` and below): `vlaforge serve` - a policy behind openpi's websocket protocol
with dynamic batching, HTTP `POST /act` and Prometheus metrics - and its clients (`PolicyClient`, `RemoteRuntime`)."""
