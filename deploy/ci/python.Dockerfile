# A stand-in for python:3.11-slim, built from Debian bookworm's own packages (bookworm's python3 is 3.11), for
# machines that reach Debian's and PyPI's mirrors but no image registry. tests/test_image.py builds it on a
# `debootstrap --variant=minbase bookworm` root file system imported as DEBIAN_IMAGE, with the host's CA bundle in
# the build context: where outgoing TLS goes through an inspecting proxy, pip inside a container trusts only what
# the host trusts.
#
#   docker build -f deploy/ci/python.Dockerfile --build-arg DEBIAN_IMAGE=… -t clawgate-ci/python:3.11 CONTEXT

ARG DEBIAN_IMAGE=clawgate-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}

# passwd: `useradd`, which minbase leaves out and the clawgate Dockerfile runs.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates passwd \
    && rm -rf /var/lib/apt/lists/*

# A file of its own, so that a later `update-ca-certificates` cannot drop the host's authorities.
COPY ca-certificates.crt /etc/ssl/certs/host-ca-bundle.crt

# A virtual environment first on PATH gives `python` and `pip` as python:3.11-slim has them, and lets pip install
# beside Debian's own Python packages without touching them.
RUN python3 -m venv /opt/python
ENV PATH=/opt/python/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt \
    LANG=C.UTF-8

CMD ["python"]
