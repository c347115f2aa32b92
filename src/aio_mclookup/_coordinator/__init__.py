"""Coordinate: options (``options``), the key table (``table``), the positive caches
(``caches``), the circuit breaker (``breaker``), the sans-IO core driving many lookups'
rounds (``core``), and the asyncio shell around it (``shell``: :class:`LookupCoordinator`)."""
