"""The front door: an HTTP gateway that takes tickets in (`gateway.app`, `ticketq-gateway`) and a
dispatcher that sends answers out by webhook (`gateway.deliver`, `ticketq-deliver`).

Both are clients of the public contract only (`producer.api.Producer`, `ticketq.*`): the gateway
is a producer like any other, the dispatcher a consumer group on the results stream.
"""
