{{/* Names of the RLJob admission webhook's objects (webhook.yaml; docs/operator.md "Admission webhook"). */}}

{{/* The Service the API server calls, and the DNS name its certificate is issued for. */}}
{{- define "rldock.webhookService" -}}
{{- printf "%s-webhook" (include "rldock.fullname" .) }}
{{- end }}

{{/* The Secret holding the webhook's CA, certificate and key, which the Deployment mounts. */}}
{{- define "rldock.webhookSecret" -}}
{{- printf "%s-webhook-cert" (include "rldock.fullname" .) }}
{{- end }}

{{/* Where the operator's container reads the Secret. */}}
{{- define "rldock.webhookCertDir" -}}
/etc/rldock/webhook
{{- end }}
