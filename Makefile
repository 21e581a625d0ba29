# Two commands do all set-up on a fresh machine: `make book` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROFILE ?= ci
# the slowest tests (and chapter cells) each pytest run prints
DURATIONS ?= 10
STAMP  := $(VENV)/.installed
# one on-disk compilation cache for the unit tests, the chapters' kernels under nbval and papermill:
# a computation one of them compiled is read back by the others (tests/conftest.py uses the same).
# Every computation goes in, the small ones too: the test workers, nbval's kernels and the commands
# the tests start each compile the same few thousand eager ops, and reading one back is cheaper
# than compiling it (unit tests + nbval, empty cache: 1049 + 849 s with a 0.5 s threshold, 864 + 803 s
# with none).
export JAX_COMPILATION_CACHE_DIR ?= $(HOME)/.cache/gradtie/jax-tests
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
# Python keeps the byte code it compiles even where the environment says not to: otherwise every
# interpreter the tests start (workers, kernels, the commands they run) compiles again whatever has
# none (the project's modules; the whole venv, when it was installed uncompiled: unit tests 310 s
# against 265 s, nbval about 40 s slower, with PYTHONDONTWRITEBYTECODE=1)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv book test test-all unit unit-all nbval notebooks clean

# the requirements are installed once per machine (interpreter and requirements.txt) into a venv
# every clone shares; .venv is a hard-linked copy of it with the project installed editable, about
# 3-4 s instead of 50 s of pip; the first build takes about a minute (tools/venv.py)
$(STAMP): requirements.txt pyproject.toml tools/venv.py
	$(PYTHON) tools/venv.py $(VENV)
	touch $(STAMP)

venv: $(STAMP)

# execute every chapter with papermill into book/, then render the HTML (fails on any warning)
book: $(STAMP)
	$(PY) -m gradtie book --profile $(PROFILE)

# nbval and the unit tests in one session, which prints its ten slowest items: each chapter, and
# each test file, runs on one worker; the chapters first and longest first, then the test files
# (tests/conftest.py), so that the short ones end the session (485 s against 493 s for `make unit
# nbval`, one after the other: within the machine's noise; one list of the slowest, one start)
test: $(STAMP)
	$(CHAPTER_COUNT)
	$(PY) -m pytest tests $(CHAPTERS_IN_ORDER) -n 2 --dist loadscope --no-loadscope-reorder -m "not slow" \
	    --nbval-lax --nbval-sanitize-with nbval_sanitize.cfg --durations=$(DURATIONS)

# everything, with the repeats that `make test` leaves to the chapters (tests/conftest.py)
test-all: unit-all nbval

unit: $(STAMP)
	$(PY) -m pytest tests -n 2 -m "not slow" --durations=$(DURATIONS)

unit-all: $(STAMP)
	$(PY) -m pytest tests -n 2 --durations=$(DURATIONS)

# nbval re-executes the committed chapter notebooks, every one of them: the chapters, the table of
# contents and the notebooks must agree first (nothing collected is a failure, never a pass). The
# order is book.CHAPTERS' costliest first (`book.nbval_order`), so that the two workers finish together.
CHAPTER_COUNT := $(PY) -c "from gradtie import book; print(len(book.chapter_notebooks()), 'chapter notebooks')"
CHAPTERS_IN_ORDER = $$($(PY) -c "from gradtie import book; book.chapter_notebooks(); print(*(p.relative_to(book.ROOT) for p in book.nbval_order()))")
nbval: $(STAMP)
	$(CHAPTER_COUNT)
	$(PY) -m pytest --nbval-lax --nbval-sanitize-with nbval_sanitize.cfg -n 2 --dist loadfile --no-loadscope-reorder --durations=$(DURATIONS) \
	    $(CHAPTERS_IN_ORDER)

# re-execute each chapter's reviewed source (notebooks/*.py) into the committed notebooks/*.ipynb
notebooks: $(STAMP)
	for f in notebooks/*.py; do $(PY) -c "import sys; from gradtie import book; book.refresh(sys.argv[1])" $$(basename $$f .py) || exit 1; done

clean:
	rm -rf _build book/_build
