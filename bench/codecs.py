"""`make bench-codecs`: what each codec does to real KV, what the quantized ones cost in
accuracy on a real model, how the chooser does on shaped links against every fixed
choice, and what quantized namespaces do to the hit ratio at the same byte capacity
(docs/codecs.md).

1. Codecs: per codec, the ratio and the encode / decode GB/s on this machine, on blocks
   of SmolLM2-135M-Instruct's KV cache (bf16) of real text; then the accuracy table of
   `bench/codec_accuracy.py` (top-1 agreement, KL, greedy continuations).
2. Links: a daemon in one network namespace and a client in another, joined by a veth
   pair whose daemon end is shaped by `tc qdisc ... tbf` to 0.2, 1, 10 and 25 Gbit/s: fetch
   time of a 4,096-token prefix (256 blocks of 16 tokens, 94 MB of bf16 KV) over the data
   lane with `lane_codec` auto (the chooser, after warm-up fetches) against raw and each
   fixed codec, medians of the rounds, alternating the modes each round; the chooser's
   ratio to the best fixed choice on each link.
3. Hit ratio: the shared conversation trace through `kvstore replay` at one byte capacity
   (5% of the trace's distinct blocks in full precision), with the capacity in blocks that
   fp8 and 4-bit namespaces get from it (their stored size at the trace's 512-token blocks).

Results: bench/results/codecs.json, codecs.md (the three tables) and codecs.png (fetch
time by link and mode). Needs root for part 2 (skipped otherwise, said so). QUICK=1: two
prompts, fewer rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

import codec_accuracy as acc  # noqa: E402

from kvstore.codecs import Codec, decode, encode  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from kvstore.quant import quantizer_for  # noqa: E402

RESULTS = REPO / "bench" / "results"
# 1, 10 and 25 Gbit/s as the issue asks; 200 Mbit/s too, a link slow enough for a lossless
# codec to pay on a machine whose cores encode at tenths of a GB/s.
LINKS = ("200mbit", "1gbit", "10gbit", "25gbit")
MODES = ("auto", "raw", "shuffle-lz4", "shuffle-zstd")
PREFIX_TOKENS = 4096
CLIENT_NS_ADDR, SERVER_NS_ADDR = "10.233.9.1", "10.233.9.2"
PORT = 50051


# ---------------------------------------------------------------------- real KV


@torch.inference_mode()
def real_kv(model: Any, tokenizer: Any, tokens: int) -> tuple[KVLayout, list[bytes]]:
    """The bf16 cache of `tokens` tokens of the project's docs, as the transformers
    adapter's blocks (16 tokens each)."""
    from kvstore.client.hf import layout_for_model, pack_blocks

    text = "\n\n".join((REPO / name).read_text() for name in acc.TEXTS)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    assert ids.shape[1] == tokens, f"the docs hold only {ids.shape[1]} tokens"
    out = model(ids, use_cache=True)
    layout = layout_for_model(model, model_id=acc.MODEL_ID, block_size_tokens=acc.BLOCK_SIZE_TOKENS)
    blocks = [bytes(b.view(torch.uint8).numpy()) for b in
              pack_blocks(out.past_key_values, layout, 0, tokens // layout.block_size_tokens)]
    return layout, blocks


def codec_speeds(layout: KVLayout, blocks: list[bytes]) -> list[dict[str, Any]]:
    """Ratio and single-thread encode / decode GB/s (of raw bytes) per codec."""
    rows = []
    raw = sum(len(b) for b in blocks)
    for codec in (Codec.SHUFFLE_LZ4, Codec.SHUFFLE_ZSTD):
        t0 = time.perf_counter()
        enc = [encode(codec, b, 2) for b in blocks]
        t1 = time.perf_counter()
        for e, b in zip(enc, blocks):
            decode(codec, e, 2, len(b))
        t2 = time.perf_counter()
        rows.append({"codec": codec.label, "kind": "lossless", "ratio": round(sum(map(len, enc)) / raw, 4),
                     "encode_gbps": round(raw / (t1 - t0) / 1e9, 3), "decode_gbps": round(raw / (t2 - t1) / 1e9, 3)})
    for name in ("fp8-e4m3", "kivi4"):
        q = quantizer_for(KVLayout(**{**_fields(layout), "kv_codec": name}))
        t0 = time.perf_counter()
        stored = q.quantize(blocks)
        t1 = time.perf_counter()
        q.dequantize(stored)
        t2 = time.perf_counter()
        rows.append({"codec": name, "kind": "lossy", "ratio": round(sum(map(len, stored)) / raw, 4),
                     "encode_gbps": round(raw / (t1 - t0) / 1e9, 3), "decode_gbps": round(raw / (t2 - t1) / 1e9, 3)})
    return rows


def _fields(layout: KVLayout) -> dict[str, Any]:
    return {f: getattr(layout, f) for f in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim",
                                            "block_size_tokens", "kv_layout")}


# ---------------------------------------------------------------------- shaped links


CLIENT = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from kvstore.client import Client
    from kvstore.layout import KVLayout

    target, token, layout_json, rounds, warm = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    layout = KVLayout(**json.loads(layout_json))
    tokens = list(range(4096))
    clients = {m: Client(target, token=token, data_plane="lane", lane_codec=m)
               for m in ("auto", "raw", "shuffle-lz4", "shuffle-zstd")}
    times = {m: [] for m in clients}
    for m, kv in clients.items():  # warm-up: connections, and the chooser's first measurements
        for _ in range(warm if m == "auto" else 1):
            assert len(kv.fetch(layout, tokens)) == 256
    for _ in range(rounds):
        for m, kv in clients.items():
            began = time.perf_counter()
            got = kv.fetch(layout, tokens)
            times[m].append(time.perf_counter() - began)
            assert len(got) == 256
    choice = clients["auto"].codec_stats
    print(json.dumps({"times": times, "choices": [{"link": c.link, "choice": c.choice, "link_gbps": c.link_gbps,
                                                   "expected_gbps": c.expected_gbps, "ratios": c.ratios,
                                                   "raw_bytes": c.raw_bytes} for c in choice]}))
    for kv in clients.values():
        kv.close()
""")


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=120)


def shaped_links(layout: KVLayout, blocks: list[bytes], rounds: int, warm: int) -> dict[str, Any]:
    """Fetch times of the 4,096-token prefix per link and mode (see the module doc)."""
    if os.geteuid() != 0:
        return {"skipped": "needs root (network namespaces, tc)"}
    from kvstore.client import Client
    from kvstore.server.auth import new_token

    tag = f"kvc{os.getpid() % 100000}"
    cns, sns, cdev, sdev = f"{tag}c", f"{tag}s", f"{tag}x", f"{tag}y"
    made: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-codecs-"))
    daemon = None
    out: dict[str, Any] = {}
    try:
        for ns in (cns, sns):
            run("ip", "netns", "add", ns)
            made.append(ns)
        run("ip", "link", "add", cdev, "netns", cns, "type", "veth", "peer", "name", sdev, "netns", sns)
        for ns, dev, addr in ((cns, cdev, CLIENT_NS_ADDR), (sns, sdev, SERVER_NS_ADDR)):
            run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        token, digest = new_token()
        tokens_file = tmp / "tokens.toml"
        tokens_file.write_text(f'[[tenant]]\nname = "b"\nrole = "admin"\ntokens = ["{digest}"]\n')
        tokens_file.chmod(0o600)
        sock = tmp / "kv.sock"
        daemon = subprocess.Popen(
            ["ip", "netns", "exec", sns, sys.executable, str(REPO / "server.py"), "--listen",
             f"unix:{sock},{SERVER_NS_ADDR}:{PORT}", "--data-lane-listen", f"{SERVER_NS_ADDR}:0",
             "--insecure-remote", "--auth-token-file", str(tokens_file), "--unix-socket-tenant", "b",
             "--host-capacity", "512MiB", "--shm-dir", str(tmp), "--metrics-listen", "off"],
            stdout=open(tmp / "daemon.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert daemon.poll() is None and time.monotonic() < deadline, (tmp / "daemon.log").read_text()
            time.sleep(0.1)
        with Client(f"unix:{sock}") as kv:
            kv.put(layout, list(range(PREFIX_TOKENS)), blocks)
        layout_json = json.dumps(_fields(layout))
        for link in LINKS:
            run("ip", "netns", "exec", sns, "tc", "qdisc", "replace", "dev", sdev, "root", "tbf", "rate", link,
                "burst", "8mb", "latency", "50ms")
            got = subprocess.run(["ip", "netns", "exec", cns, sys.executable, "-c", CLIENT,
                                  f"{SERVER_NS_ADDR}:{PORT}", token, layout_json, str(rounds), str(warm)],
                                 capture_output=True, text=True, timeout=1800, cwd=REPO)
            if got.returncode != 0:
                raise RuntimeError(f"the client on {link} failed:\n{got.stderr[-3000:]}")
            res = json.loads(got.stdout.strip().splitlines()[-1])
            medians = {m: statistics.median(ts) for m, ts in res["times"].items()}
            best_fixed = min((m for m in MODES if m != "auto"), key=lambda m: medians[m])
            out[link] = {"median_s": {m: round(v, 4) for m, v in medians.items()},
                         "rounds_s": {m: [round(t, 4) for t in ts] for m, ts in res["times"].items()},
                         "best_fixed": best_fixed,
                         "auto_over_best_fixed": round(medians["auto"] / medians[best_fixed], 3),
                         "auto_over_raw": round(medians["auto"] / medians["raw"], 3),
                         "raw_gbps": {m: round(len(blocks) * layout.bytes_per_block / v / 1e9, 3)
                                      for m, v in medians.items()},
                         "chooser_pick": _pick(res["choices"]),
                         "chooser": res["choices"]}
            print(f"  {link}: " + ", ".join(f"{m} {medians[m]:.3f}s" for m in MODES)
                  + f"; auto / best fixed ({best_fixed}) = {out[link]['auto_over_best_fixed']}; "
                  f"the chooser's pick: {out[link]['chooser_pick']}", flush=True)
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
        for ns in made:
            for pid in run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run("ip", "netns", "del", ns, check=False)
    return out


def _pick(choices: list[dict[str, Any]]) -> str:
    """The codec the chooser's fetch link uses next, after the rounds (`?` if it learned
    nothing, e.g. every transfer under its 1 MiB floor)."""
    picks = [c["choice"] for c in choices if c["link"].endswith("fetch")]
    return picks[-1] if picks else "?"


# ---------------------------------------------------------------------- hit ratio


def hit_ratios(trace: Path, layout: KVLayout) -> dict[str, Any]:
    """`kvstore replay` at one byte capacity: the full-precision capacity in blocks, and
    what fp8 and kivi4 namespaces hold in the same bytes (at the trace's 512-token blocks)."""
    if not trace.exists():
        return {"skipped": f"no trace at {trace}"}
    distinct = len({h for line in trace.read_text().splitlines() if line.strip()
                    for h in json.loads(line)["hash_ids"]})
    dense_blocks = max(1, int(distinct * 0.05))
    big = KVLayout(**{**_fields(layout), "block_size_tokens": 512})
    rows = []
    for codec in ("", "fp8-e4m3", "kivi4"):
        lay = KVLayout(**{**_fields(big), "kv_codec": codec})
        ratio = lay.bytes_per_block / lay.dense_block_bytes
        blocks = int(dense_blocks / ratio)
        got = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "replay", str(trace), "--capacity-blocks",
                              str(blocks), "--policy", "lru,arc", "--json"], capture_output=True, text=True,
                             timeout=1800, cwd=REPO)
        if got.returncode != 0:
            raise RuntimeError(got.stderr[-2000:])
        res = json.loads(got.stdout)
        rows.append({"codec": codec or "none", "bytes_ratio": round(ratio, 4), "capacity_blocks": blocks,
                     "hit_ratio": {r["policy"]: r["hit_ratio"] for r in _results(res)}})
    return {"distinct_blocks": distinct, "capacity_bytes_as_dense_blocks": dense_blocks, "rows": rows}


def _results(res: Any) -> list[dict[str, Any]]:
    rows = res.get("results", res) if isinstance(res, dict) else res
    return [{"policy": r.get("policy"), "hit_ratio": r.get("hit_ratio", r.get("block_hit_ratio"))} for r in rows]


# ---------------------------------------------------------------------- report


def report(result: dict[str, Any]) -> str:
    lines = ["# Codecs (make bench-codecs)", "", f"Machine: {os.cpu_count()} CPUs. Model: SmolLM2-135M-Instruct "
             "(GGUF Q4_1 weights, run in bf16), KV of the project's docs pages.", "",
             "## 1. Codecs on real KV, and accuracy", "",
             "| codec | kind | ratio | encode GB/s | decode GB/s | top-1 | KL mean (nats) | KL max | greedy 32 identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    accuracy = {r["codec"]: r for r in result["accuracy"]}
    for row in result["codecs"]:
        a = accuracy.get(row["codec"], {})
        lines.append(f"| {row['codec']} | {row['kind']} | {row['ratio']} | {row['encode_gbps']} | "
                     f"{row['decode_gbps']} | {a.get('top1_agreement', 'exact')} | {a.get('kl_mean_nats', 0)} | "
                     f"{a.get('kl_max_nats', 0)} | {a.get('greedy32_identical', 'all')} |")
    none = accuracy.get("none")
    if none:
        lines.append(f"| none (control) | - | 1.0 | - | - | {none['top1_agreement']} | {none['kl_mean_nats']} | "
                     f"{none['kl_max_nats']} | {none['greedy32_identical']} |")
    lines += ["", f"Accuracy: {none['prompts'] if none else '?'} prompts, {none['positions'] if none else '?'} "
              "next-token positions in all; the lossless codecs' rows are exact by construction (their round "
              "trips are checked bit for bit by the tests).", "", "## 2. Fetch of a 4,096-token prefix over shaped links", ""]
    links = result["links"]
    if "skipped" in links:
        lines.append(f"skipped: {links['skipped']}")
    else:
        lines += [f"Median of {result.get('links_rounds', '?')} fetches (and GB/s of the bf16 bytes delivered) "
                  "per mode, the modes in turn each round; `auto` is the chooser, its pick the codec its fetch "
                  "link used after the rounds.", "",
                  "| link | " + " | ".join(MODES) + " | chooser's pick | best fixed | auto / best fixed | auto / raw |",
                  "|---|" + "---|" * (len(MODES) + 4)]
        for link in (k for k in LINKS if k in links):
            r = links[link]
            gbps = r.get("raw_gbps", {})
            lines.append(f"| {link} | " + " | ".join(
                f"{r['median_s'][m]:.3f} s" + (f" ({gbps[m]} GB/s)" if m in gbps else "") for m in MODES)
                + f" | {r.get('chooser_pick', _pick(r['chooser']))} | {r['best_fixed']} | "
                f"{r['auto_over_best_fixed']} | {r['auto_over_raw']} |")
    lines += ["", "## 3. Hit ratio at the same byte capacity (conversation trace)", ""]
    hits = result["hits"]
    if "skipped" in hits:
        lines.append(f"skipped: {hits['skipped']}")
    else:
        policies = sorted(hits["rows"][0]["hit_ratio"])
        lines += ["| codec | bytes / full precision | capacity (blocks) | " + " | ".join(policies) + " |",
                  "|---|---|---|" + "---|" * len(policies)]
        for row in hits["rows"]:
            lines.append(f"| {row['codec']} | {row['bytes_ratio']} | {row['capacity_blocks']} | "
                         + " | ".join(f"{row['hit_ratio'][p]:.4f}" for p in policies) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    links = result["links"]
    if "skipped" in links:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    for i, mode in enumerate(MODES):
        ax.bar([j + i * width for j in range(len(LINKS))], [links[link]["median_s"][mode] for link in LINKS],
               width, label=mode)
    ax.set_xticks([j + 1.5 * width for j in range(len(LINKS))], LINKS)
    ax.set_yscale("log")
    ax.set_ylabel("fetch of a 4,096-token prefix (s, log scale)")
    ax.set_title("SmolLM2-135M bf16 KV over the data lane, daemon egress shaped by tbf")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trace", default=str(REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"))
    parser.add_argument("--rounds", type=int, default=0, help="timed fetches per link and mode (default 5, quick 3)")
    parser.add_argument("--links-only", action="store_true",
                        help="measure the shaped links again and replace that part of an earlier run's results")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    RESULTS.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    began = time.perf_counter()
    model, tokenizer = acc.load_model()
    print(f"model loaded in {time.perf_counter() - began:.0f} s", flush=True)
    layout, blocks = real_kv(model, tokenizer, PREFIX_TOKENS)
    if args.links_only:
        if not (RESULTS / "codecs.md").exists():
            sys.exit(f"--links-only replaces part of an earlier full run's results; none in {RESULTS}")
        earlier = json.loads((RESULTS / "codecs.json").read_text())
        earlier["links"] = shaped_links(layout, blocks, rounds=rounds, warm=4)
        earlier["links_rounds"] = rounds
        (RESULTS / "codecs.json").write_text(json.dumps(earlier, indent=1))
        text = report(earlier)
        (RESULTS / "codecs.md").write_text(text)
        plot(earlier, RESULTS / "codecs.png")
        print(text)
        return
    result: dict[str, Any] = {"layout": _fields(layout), "block_bytes": layout.bytes_per_block,
                              "codecs": codec_speeds(layout, blocks)}
    print("codecs:", json.dumps(result["codecs"]), flush=True)
    def save() -> None:  # after each part: a run cut short keeps what it measured
        (RESULTS / "codecs.json").write_text(json.dumps(result, indent=1))

    save()
    result["links"] = shaped_links(layout, blocks, rounds=rounds, warm=4)
    result["links_rounds"] = rounds
    save()
    result["hits"] = hit_ratios(Path(args.trace), layout)
    save()
    from conftest import daemon_in_thread, make_config

    from kvstore.client import Client

    with tempfile.TemporaryDirectory() as tmp, daemon_in_thread(make_config(Path(tmp), host_capacity=512 << 20)) \
            as running, Client(running.unix_target) as kv:
        prompts = acc.prompts(tokenizer, 2 if args.quick else 4, 512)
        result["accuracy"] = [r.row() for r in acc.measure(model, kv, prompts, ["", "fp8-e4m3", "kivi4"])]
    print("accuracy:", json.dumps(result["accuracy"]), flush=True)
    result["seconds"] = round(time.perf_counter() - began, 1)
    (RESULTS / "codecs.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (RESULTS / "codecs.md").write_text(text)
    plot(result, RESULTS / "codecs.png")
    print(text)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
