# vllm-router (a Rust binary shipped as a PyPI wheel) in front of the vLLM replicas of the `scale` stack
# (docker-compose.scale.yml). Its own small image: the router needs neither torch nor clawgate.
#
#   docker build -f deploy/router.Dockerfile -t clawgate-router deploy

FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Pinned: the policy names and the session headers it hashes on are checked against this release.
ARG VLLM_ROUTER_REQUIREMENT="vllm-router==0.1.17"
RUN pip install "${VLLM_ROUTER_REQUIREMENT}" \
    && useradd --create-home --uid 1000 --user-group router

USER router
ENTRYPOINT ["vllm-router"]
