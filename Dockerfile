# canaryd container image: `docker build -t canaryd:0.1.0 .`; the released one,
# ghcr.io/ORG/canaryd, is this file built by `make dist` (release/dist.sh).
#
# Stage 1 builds a virtualenv with canaryd and its dependencies; stage 2 copies
# only that venv onto a clean slim base. The image runs as a numeric non-root
# user and writes nothing outside /tmp, so it works with a read-only root
# filesystem (mount an emptyDir at /tmp).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# make dist passes the commit's time: pip's bytecode is then hash-checked, not dated.
ARG SOURCE_DATE_EPOCH
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY canaryd ./canaryd
RUN python -m venv /opt/canaryd \
 && /opt/canaryd/bin/pip install --upgrade pip \
 && /opt/canaryd/bin/pip install . \
 && /opt/canaryd/bin/canaryd --version

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/canaryd /opt/canaryd
ENV PATH=/opt/canaryd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 65532:65532
EXPOSE 8085
ENTRYPOINT ["canaryd"]
