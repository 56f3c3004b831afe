"""HTTP routers, one module per protocol. Routes only translate between HTTP and the serving core."""
