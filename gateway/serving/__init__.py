"""What answers a request: the HTTP app and its handlers, the live driver of the scheduling loop, the relay
to upstream instances, progressive mode, telemetry scraping and Prometheus metrics."""
