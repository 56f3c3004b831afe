# The clawgate image: gateway, migrations, trainer and reward worker (`clawgate serve | db upgrade | train | judge`),
# for a GPU host.
#
# Layers go from the slowest-changing to the fastest: torch (several GB), then the project's dependencies read from
# pyproject.toml, then the source. Editing code rebuilds only the last layer.
#
#   docker build -t clawgate .
#   docker run --rm -p 8080:8080 clawgate         # demo: SQLite and the tiny CPU model, built at first start
#
# Build arguments (the defaults build the image users run):
#   BASE_IMAGE         the Python 3.11 image to build on (default python:3.11-slim). Any image with `python` and
#                      `pip` first on PATH and `useradd` will do: the test suite builds on one made from Debian's
#                      packages where no registry can be reached (tests/test_image.py).
#   TORCH_REQUIREMENT  the torch requirement pip installs first (default: the `train` extra's bounds, which on
#                      Linux resolve to a CUDA build); e.g. "torch==2.13.0+cpu" for a CPU-only image.
#   TORCH_PIP_OPTIONS  extra options of that one `pip install` (empty by default), for a wheel that is not on the
#                      index: e.g. "--index-url https://download.pytorch.org/whl/cpu", or "--find-links URL
#                      --trusted-host HOST" for a folder of wheels served over plain HTTP.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Directories the compose volumes mount over: a new named volume takes its owner from the image, so the
# non-root user can write policy versions, spool files and the model cache.
RUN useradd --create-home --uid 1000 --user-group clawgate \
    && mkdir -p /adapters /data /hf-cache \
    && chown clawgate:clawgate /adapters /data /hf-cache

# The default PyPI Linux wheel of torch is a CUDA build. Same bounds as the `train` extra in pyproject.toml.
ARG TORCH_REQUIREMENT="torch>=2.4,<=2.14.1"
ARG TORCH_PIP_OPTIONS=""
RUN pip install ${TORCH_PIP_OPTIONS} "${TORCH_REQUIREMENT}"

WORKDIR /src
COPY pyproject.toml ./
# The runtime, `train` and `judge` dependencies alone, so that a source change does not reinstall them.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['train'] + p['optional-dependencies']['judge']))" \
    > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY migrations ./migrations
COPY prefix_tree ./prefix_tree
COPY trainer ./trainer
COPY runner ./runner
COPY rewards ./rewards
COPY gateway ./gateway
COPY clawgate ./clawgate
RUN pip install ".[train,judge]" && rm -rf build *.egg-info

USER clawgate
# Relative defaults (SQLite file, tiny model, spool) land in the writable /data.
WORKDIR /data
ENV HF_HOME=/hf-cache \
    CLAWGATE_HOST=0.0.0.0 \
    CLAWGATE_ADAPTER_DIR=/adapters
EXPOSE 8080

ENTRYPOINT ["clawgate"]
CMD ["up"]
