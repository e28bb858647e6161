# One image for the router, the nodes and the demo upstream; the command picks the role.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ring ./ring
COPY node ./node
COPY router ./router
COPY simulations ./simulations
COPY benchmarks ./benchmarks
RUN pip install --no-cache-dir . && useradd --system ringlimit
USER ringlimit
ENTRYPOINT ["ringlimit"]
CMD ["--help"]
