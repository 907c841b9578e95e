"""Write-back: each answer written to the helpdesk ticket it came from, through the helpdesk's REST
API (`ticketq-writeback`): the config (`config`), the requests (`adapters`), the consumer (`consumer`),
its settings (`settings`) and command (`cli`)."""
