"""Store: the interfaces (``protocol``), an in-process fake (``fake``), Mooncake's error codes
(``codes``), the crash-proof client pool (``pool``) and :class:`MooncakeStore` (``mooncake``);
the master's watch and epochs (``watch``), ``etcd://`` addresses of HA masters (``etcd``), and
a Mooncake client in a child process of its own (``isolated``, run as ``isolated_host``)."""
