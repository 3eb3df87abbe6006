{{/* The gateway's credentials at the broker, and where they are mounted. */}}

{{/* The Secret with the client certificate the gateway presents (tls.crt, tls.key), or "" when
it presents none: gateway.credentials.tlsSecret, else the chart's client certificate (mutual TLS,
no identity: its token names it). None without TLS (a certificate needs the broker's CA). */}}
{{- define "crossflow.gatewayClientTls" -}}
{{- if include "crossflow.brokerTlsSecret" . }}
{{- default (include "crossflow.clientTlsSecret" .) .Values.gateway.credentials.tlsSecret }}
{{- end }}
{{- end }}

{{/* The Secret whose key <gateway.routerName> is the gateway's bearer token, or "":
gateway.credentials.tokenSecret, else the chart's router tokens (crossflow.routerTokenNames). */}}
{{- define "crossflow.gatewayTokenSecret" -}}
{{- if .Values.gateway.credentials.tokenSecret }}
{{- .Values.gateway.credentials.tokenSecret }}
{{- else if include "crossflow.generatedTokens" . }}
{{- include "crossflow.componentName" (dict "root" . "component" "router-tokens") }}
{{- end }}
{{- end }}

{{/* The ServiceAccount the gateway runs as: its own when it discovers engines (it lists pods
with its token), else the chart's (which mounts no token). */}}
{{- define "crossflow.gatewayServiceAccountName" -}}
{{- if .Values.gateway.discovery.enabled }}
{{- include "crossflow.componentName" (dict "root" . "component" "gateway") }}
{{- else }}
{{- include "crossflow.serviceAccountName" . }}
{{- end }}
{{- end }}

{{/* The gateway's broker_auth (ClientCredentials) as YAML: the broker's CA and name, the client
certificate, the router token, at the paths gateway-deployment.yaml mounts them. */}}
{{- define "crossflow.gatewayBrokerAuth" -}}
{{- $auth := dict }}
{{- if include "crossflow.brokerTlsSecret" . }}
{{- $_ := set $auth "ca_file" "/var/run/crossflow/broker-ca/ca.crt" }}
{{- $_ := set $auth "server_name" (include "crossflow.brokerServerName" .) }}
{{- end }}
{{- if include "crossflow.gatewayClientTls" . }}
{{- $_ := set $auth "cert_file" "/var/run/crossflow/client-tls/tls.crt" }}
{{- $_ := set $auth "key_file" "/var/run/crossflow/client-tls/tls.key" }}
{{- end }}
{{- if include "crossflow.gatewayTokenSecret" . }}
{{- $_ := set $auth "token_file" (printf "/var/run/crossflow/router-token/%s" .Values.gateway.routerName) }}
{{- end }}
{{- toYaml $auth }}
{{- end }}
