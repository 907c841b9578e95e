"""The review page: a person decides the results the workers flagged for review (`store`: the
review stream per tenant, decisions written once; `session`: the browser's signed session and CSRF
tokens; `pages`: the routes and templates). See docs/review.md."""
