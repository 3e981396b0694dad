# The eop image: `eop` is the entry point, so `docker run IMAGE worker module:app`.
# compose.yaml builds and uses it; see there for the NATS and PostgreSQL side.

# Build stage: the eop wheel and wheels for all its dependencies.
FROM python:3.12-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY eop ./eop
COPY migrations ./migrations
RUN pip wheel --wheel-dir /wheels ".[metrics]"

# Runtime stage: installed from the wheels only, no sources, no build tools.
FROM python:3.12-slim
# PYTHONPATH: the example apps are plain modules under /app, not part of the wheel.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app
# The developer tools (eop/tools: `eop chaos`, `eop bench`, `eop demo`, the embedded
# servers) have no place here: deleted after the install. Nothing `eop worker` or
# `eop relay` runs imports them, and those commands say in one line how to get them.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels "eop[metrics]" \
    && rm -r "$(python -c 'import eop.tools, os; print(os.path.dirname(eop.tools.__file__))')"
RUN useradd --create-home --uid 10001 --user-group eop
WORKDIR /app
COPY --chown=eop:eop examples ./examples
USER eop
ENTRYPOINT ["eop"]
CMD ["--help"]
