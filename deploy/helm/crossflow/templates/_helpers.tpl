{{/* Names, labels and shared snippets. */}}

{{- define "crossflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "crossflow.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's full name: <fullname>-<component>, kept within 63 characters. */}}
{{- define "crossflow.componentName" -}}
{{- printf "%s-%s" (include "crossflow.fullname" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component }}
{{- end }}

{{- define "crossflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "crossflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: crossflow
{{- end }}

{{/* Selector labels of one component: dict "root" $ "component" "broker". */}}
{{- define "crossflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "crossflow.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "crossflow.componentLabels" -}}
{{ include "crossflow.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "crossflow.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "crossflow.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "crossflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding the Redis password, or "" when Redis has none: the existing one, else
the chart's (redis.password, or for bundled Redis one generated and kept across upgrades). */}}
{{- define "crossflow.redisSecretName" -}}
{{- $r := .Values.redis -}}
{{- if $r.existingSecret }}
{{- $r.existingSecret }}
{{- else if or $r.password (eq $r.mode "bundled") }}
{{- include "crossflow.componentName" (dict "root" . "component" "redis-auth") }}
{{- end }}
{{- end }}

{{/* Redis URL without credentials: the external one, or the bundled StatefulSet's Service. */}}
{{- define "crossflow.redisUrl" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- printf "redis://%s:%d/0" (include "crossflow.componentName" (dict "root" . "component" "redis")) (int .Values.redis.bundled.port) }}
{{- else }}
{{- required "redis.external.url is required when redis.mode is external" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/*
Environment giving a process CROSSFLOW_REDIS_URL. With a password Secret, the password enters
the URL through Kubernetes' $(VAR) expansion, so it never sits in a ConfigMap. It must be
URL-safe (percent-encode anything else when you create the Secret).
*/}}
{{- define "crossflow.redisEnv" -}}
{{- $url := include "crossflow.redisUrl" . -}}
{{- $secret := include "crossflow.redisSecretName" . -}}
{{- if $secret }}
{{- $parts := splitn "://" 2 $url }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.redis.passwordKey }}
- name: CROSSFLOW_REDIS_URL
  value: {{ printf "%s://:$(REDIS_PASSWORD)@%s" $parts._0 $parts._1 | quote }}
{{- else }}
- name: CROSSFLOW_REDIS_URL
  value: {{ $url | quote }}
{{- end }}
{{- end }}

{{- define "crossflow.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "crossflow.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Where the broker's certificates come from: "secret" (security.tls.secretName), "cert-manager"
(security.certManager.enabled, or "auto" on a cluster that serves cert-manager.io/v1), "generated"
(by Helm, kept across upgrades), or "" without TLS.
*/}}
{{- define "crossflow.tlsSource" -}}
{{- $s := .Values.security -}}
{{- $cm := $s.certManager.enabled -}}
{{- if not $s.tls.enabled }}
{{- else if $s.tls.secretName }}secret
{{- else if and (kindIs "bool" $cm) $cm }}cert-manager
{{- else if and (eq (toString $cm) "auto") (.Capabilities.APIVersions.Has "cert-manager.io/v1") }}cert-manager
{{- else }}generated
{{- end }}
{{- end }}

{{/* The Secret with the broker's tls.crt, tls.key and ca.crt, or "" without TLS. */}}
{{- define "crossflow.brokerTlsSecret" -}}
{{- $source := include "crossflow.tlsSource" . -}}
{{- if eq $source "secret" }}
{{- .Values.security.tls.secretName }}
{{- else if $source }}
{{- include "crossflow.componentName" (dict "root" . "component" "broker-tls") }}
{{- end }}
{{- end }}

{{/* The Secret with a client certificate (no identity: no SPIFFE URI) that in-cluster callers
without one of their own present for mutual TLS (agents, the admin check in NOTES), or "" when the
chart makes none (no mutual TLS, or certificates from security.tls.secretName). */}}
{{- define "crossflow.clientTlsSecret" -}}
{{- $source := include "crossflow.tlsSource" . -}}
{{- if and .Values.security.tls.mutual (or (eq $source "cert-manager") (eq $source "generated")) }}
{{- include "crossflow.componentName" (dict "root" . "component" "client-tls") }}
{{- end }}
{{- end }}

{{/* "true" when the chart makes the bearer tokens (admin, routers, agents):
security.generated.tokens, and no token file of the user's (security.tokenHashesSecret, or
broker.config.auth.token_file). */}}
{{- define "crossflow.generatedTokens" -}}
{{- $s := .Values.security -}}
{{- $own := dig "auth" "token_file" "" (default (dict) .Values.broker.config) -}}
{{- if and (not $s.tokenHashesSecret) (not $own) $s.generated.tokens }}true{{ end }}
{{- end }}

{{/* The nodes the chart makes agent tokens for, comma-separated and sorted: those listed in
security.generated.agentNodes and, with discoverAgentNodes, the nodes the cluster has labelled
with agent.roleLabel=<a role in agent.roles> at install or upgrade (none under helm template). */}}
{{- define "crossflow.agentTokenNodes" -}}
{{- $nodes := list -}}
{{- range .Values.security.generated.agentNodes }}{{ $nodes = append $nodes . }}{{ end -}}
{{- if and .Values.agent.enabled .Values.security.generated.discoverAgentNodes -}}
{{- $found := lookup "v1" "Node" "" "" -}}
{{- range (dig "items" (list) $found) -}}
{{- $role := dig "metadata" "labels" $.Values.agent.roleLabel "" . -}}
{{- if has $role $.Values.agent.roles }}{{ $nodes = append $nodes .metadata.name }}{{ end -}}
{{- end -}}
{{- end -}}
{{- $nodes | uniq | sortAlpha | join "," -}}
{{- end }}

{{/* The routers the chart makes tokens for, comma-separated: security.generated.routers, and
gateway.routerName when the gateway is enabled without a token of its own. */}}
{{- define "crossflow.routerTokenNames" -}}
{{- $names := .Values.security.generated.routers -}}
{{- $gw := .Values.gateway -}}
{{- if and $gw.enabled (not $gw.credentials.tokenSecret) }}{{ $names = append $names $gw.routerName }}{{ end -}}
{{- $names | uniq | join "," -}}
{{- end }}

{{/* The issuerRef of the chart's cert-manager Certificates: security.certManager.issuerRef, or
the chart's own CA Issuer when it names none. */}}
{{- define "crossflow.issuerRef" -}}
{{- $ref := .Values.security.certManager.issuerRef -}}
{{- if $ref.name }}
{{- toYaml $ref }}
{{- else }}
name: {{ include "crossflow.componentName" (dict "root" . "component" "ca") }}
kind: Issuer
group: cert-manager.io
{{- end }}
{{- end }}

{{/* The name callers check the broker's certificate against. */}}
{{- define "crossflow.brokerServerName" -}}
{{- $broker := include "crossflow.componentName" (dict "root" . "component" "broker") -}}
{{- default (printf "%s.%s.svc" $broker .Release.Namespace) .Values.security.tls.serverName }}
{{- end }}

{{/* "true" when each agent has a certificate of its own (a SPIFFE URI naming its node):
security.agentCredentials.tlsSecret, or cert-manager's per-node Certificates. */}}
{{- define "crossflow.agentPerNodeCerts" -}}
{{- $s := .Values.security -}}
{{- if or $s.agentCredentials.tlsSecret (and (eq (include "crossflow.tlsSource" .) "cert-manager") $s.certManager.agentNodes) }}true{{ end }}
{{- end }}

{{/* The engine's Prometheus URL: agent.engineMetricsUrl, else the engine's default port on the
     node: vLLM serves on 8000, SGLang on 30000 (the synthetic source reads no URL). */}}
{{- define "crossflow.engineMetricsUrl" -}}
{{- if .Values.agent.engineMetricsUrl }}
{{- .Values.agent.engineMetricsUrl }}
{{- else }}
{{- printf "http://$(NODE_IP):%d/metrics" (ternary 8000 30000 (eq .Values.agent.engine "vllm")) }}
{{- end }}
{{- end }}
