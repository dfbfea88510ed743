"""The pipe demo: a producer process sends a KV-cache-sized tensor to a consumer process over the Transfer Engine.

    .venv/bin/python scripts/demo_pipe.py [--tokens 1024] [--layers 28] [--repeats 5]

The tensor is shaped like one request's KV cache of a Qwen2.5-7B-sized model (layers x K/V x tokens x 4 KV heads x
128, bf16: 56 KiB per token). The consumer checks every byte and answers, and the producer prints the time from
send to answer. Uses MOONCAKE_CONFIG_PATH if set, else the embedded default (everything on 127.0.0.1, P2PHANDSHAKE).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import secrets
import sys
import time

import torch

from kv_pipe import CONFIG_ENV, SECRET_ENV, MooncakePipe, MooncakeTransferEngineConfig

KV_HEADS, HEAD_DIM = 4, 128


def kv_tensor(layers: int, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)


def consumer(config: MooncakeTransferEngineConfig, layers: int, tokens: int, repeats: int, results: mp.Queue) -> None:
    with MooncakePipe(kv_rank=1, config=config) as pipe:
        for i in range(repeats):
            kv = pipe.recv_tensor()
            pipe.send_tensor(None)  # "arrived": the producer stops its clock
            assert kv is not None
            results.put(bool(torch.equal(kv.view(torch.int16), kv_tensor(layers, tokens, seed=i).view(torch.int16))))
        pipe.recv_tensor()  # the producer's goodbye


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens the KV covers (default 1024)")
    parser.add_argument("--layers", type=int, default=28, help="model layers (default 28, as Qwen2.5-7B)")
    parser.add_argument("--repeats", type=int, default=5, help="how many times to send it (default 5)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

    if os.environ.get(CONFIG_ENV):
        config = MooncakeTransferEngineConfig.load_from_env()
        source = os.environ[CONFIG_ENV]
    else:
        # a fresh shared secret for the two processes (the child inherits it), as a deployment sets one
        os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))
        config = MooncakeTransferEngineConfig()
        source = "the embedded default (set MOONCAKE_CONFIG_PATH to use your mooncake.json)"
    print(f"config: {source}")
    print(f"  producer pipe {config.prefill_url}, consumer pipe {config.decode_url}, metadata {config.metadata_server}, "
          f"protocol {config.protocol}")

    results: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=consumer, args=(config, args.layers, args.tokens, args.repeats, results))
    proc.start()
    nbytes = 0
    ok = True
    try:
        with MooncakePipe(kv_rank=0, config=config) as pipe:
            print(f"\n{'send':>4} | {'KV MiB':>7} | {'ms':>7} | {'GB/s':>5} | check")
            print(f"{'-' * 4} | {'-' * 7} | {'-' * 7} | {'-' * 5} | -----")
            for i in range(args.repeats):
                kv = kv_tensor(args.layers, args.tokens, seed=i)
                nbytes = kv.numel() * kv.element_size()
                start = time.perf_counter()
                pipe.send_tensor(kv)
                pipe.recv_tensor()
                elapsed = time.perf_counter() - start
                good = results.get(timeout=60)
                ok &= good
                print(f"{i + 1:>4} | {nbytes / 2**20:>7.1f} | {elapsed * 1e3:>7.1f} | {nbytes / elapsed / 1e9:>5.2f} | "
                      f"{'bit-exact' if good else 'MISMATCH'}")
            pipe.send_tensor(None)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    kib_per_token = nbytes / args.tokens / 1024 if args.tokens else 0
    print(f"\n{args.tokens} tokens x {kib_per_token:.0f} KiB/token moved producer -> consumer over the Mooncake Transfer "
          f"Engine ({config.protocol}); {'all bit-exact' if ok else 'SOME TRANSFERS DIFFERED'}.")
    return 0 if ok and proc.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
