"""`fastremover serve`: an HTTP removal service with an OpenAI-style `/v1/videos` API (see docs/serving.md).

Needs the `serve` extra (FastAPI, uvicorn, python-multipart): `pip install "fastremover[serve]"` (in a source checkout:
`pip install -e ".[serve]"`).
"""
