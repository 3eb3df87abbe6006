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

{{/* The Secret holding the Redis password, or "" when Redis has none. */}}
{{- define "crossflow.redisSecretName" -}}
{{- $r := .Values.redis -}}
{{- if $r.existingSecret }}
{{- $r.existingSecret }}
{{- else if $r.password }}
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

{{/* The Secret with the broker's tls.crt, tls.key and ca.crt, or "" without TLS. */}}
{{- define "crossflow.brokerTlsSecret" -}}
{{- $s := .Values.security -}}
{{- if $s.tls.enabled }}
{{- if $s.tls.secretName }}
{{- $s.tls.secretName }}
{{- else if $s.certManager.enabled }}
{{- include "crossflow.componentName" (dict "root" . "component" "broker-tls") }}
{{- else }}
{{- fail "security.tls.enabled needs security.tls.secretName or security.certManager.enabled" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name callers check the broker's certificate against. */}}
{{- define "crossflow.brokerServerName" -}}
{{- $broker := include "crossflow.componentName" (dict "root" . "component" "broker") -}}
{{- default (printf "%s.%s.svc" $broker .Release.Namespace) .Values.security.tls.serverName }}
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
