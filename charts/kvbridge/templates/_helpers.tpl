{{/*
Naming, labels and small computed values shared by every template.
*/}}

{{- define "kvbridge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: the release name, or "<release>-<chart>" when the release name does not already
contain the chart name. Truncated to leave room for the suffixes below ("-webhook", "-agent"...).
*/}}
{{- define "kvbridge.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvbridge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvbridge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvbridge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvbridge.labels" -}}
helm.sh/chart: {{ include "kvbridge.chart" . }}
{{ include "kvbridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvbridge
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of the operator's own objects (Deployment, Services, RBAC). */}}
{{- define "kvbridge.operatorLabels" -}}
{{ include "kvbridge.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvbridge.operatorSelectorLabels" -}}
{{ include "kvbridge.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of the P/D router's objects. */}}
{{- define "kvbridge.routerLabels" -}}
{{ include "kvbridge.labels" . }}
app.kubernetes.io/component: router
{{- end }}

{{- define "kvbridge.routerSelectorLabels" -}}
{{ include "kvbridge.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end }}

{{/* Labels of the objects granted to the serving pods (agent side). */}}
{{- define "kvbridge.agentLabels" -}}
{{ include "kvbridge.labels" . }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "kvbridge.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvbridge.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvbridge.agentServiceAccountName" -}}
{{- default (printf "%s-agent" (include "kvbridge.fullname" .)) .Values.agent.serviceAccount.name }}
{{- end }}

{{- define "kvbridge.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
Namespaces the operator watches, as a JSON list (use with fromJsonArray): none in cluster
scope, else operator.watchNamespaces or, when that is empty, the release namespace.
*/}}
{{- define "kvbridge.watchNamespaces" -}}
{{- if eq .Values.operator.scope "cluster" }}
{{- list | toJson }}
{{- else }}
{{- $ns := .Values.operator.watchNamespaces | default (list .Release.Namespace) }}
{{- $ns | uniq | toJson }}
{{- end }}
{{- end }}

{{/* Namespaces the serving pods run in, as a JSON list: agent.namespaces or the release namespace. */}}
{{- define "kvbridge.agentNamespaces" -}}
{{- .Values.agent.namespaces | default (list .Release.Namespace) | uniq | toJson }}
{{- end }}

{{/* The operator's leader-election Lease (in the release namespace). */}}
{{- define "kvbridge.leaseName" -}}
{{- .Values.operator.leaderElection.leaseName | default (printf "%s-operator" (include "kvbridge.fullname" .)) }}
{{- end }}

{{/*
Checks of operator values the schema cannot express: the leader election's timing (the
operator refuses the same at start-up) and several replicas without leader election.
*/}}
{{- define "kvbridge.operatorChecks" -}}
{{- $op := .Values.operator }}
{{- $le := $op.leaderElection }}
{{- if $le.enabled }}
{{- if not (lt (float64 $le.renewDeadlineSeconds) (float64 $le.leaseDurationSeconds)) }}
{{- fail "operator.leaderElection.renewDeadlineSeconds must be less than leaseDurationSeconds" }}
{{- end }}
{{- if not (lt (float64 $le.retryPeriodSeconds) (float64 $le.renewDeadlineSeconds)) }}
{{- fail "operator.leaderElection.retryPeriodSeconds must be less than renewDeadlineSeconds" }}
{{- end }}
{{- else if gt (int $op.replicas) 1 }}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled: without it every replica would act" }}
{{- end }}
{{- end }}

{{- define "kvbridge.webhookServiceName" -}}
{{- printf "%s-webhook" (include "kvbridge.fullname" .) }}
{{- end }}

{{- define "kvbridge.metricsServiceName" -}}
{{- printf "%s-metrics" (include "kvbridge.fullname" .) }}
{{- end }}

{{/* Secret holding the webhook serving certificate (tls.crt, tls.key, ca.crt). */}}
{{- define "kvbridge.webhookCertSecret" -}}
{{- if eq .Values.webhook.certs.source "secret" }}
{{- required "webhook.certs.secret.name is required when webhook.certs.source is secret" .Values.webhook.certs.secret.name }}
{{- else }}
{{- printf "%s-webhook-tls" (include "kvbridge.fullname" .) }}
{{- end }}
{{- end }}

{{- define "kvbridge.certManagerCertificateName" -}}
{{- printf "%s-webhook" (include "kvbridge.fullname" .) }}
{{- end }}

{{- define "kvbridge.certManagerIssuerName" -}}
{{- printf "%s-selfsigned" (include "kvbridge.fullname" .) }}
{{- end }}

{{/* Mount point of the webhook certificate inside the operator container. */}}
{{- define "kvbridge.webhookCertDir" -}}
/etc/kvbridge/webhook-tls
{{- end }}

{{/*
Name of cluster-scoped objects (ClusterRole, ClusterRoleBinding, webhook configuration). A
namespaced install adds its namespace, so that teams can each install the chart under the same
release name in their own namespace.
*/}}
{{- define "kvbridge.clusterName" -}}
{{- if eq .Values.operator.scope "namespaced" }}
{{- printf "%s-%s" (include "kvbridge.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- include "kvbridge.fullname" . }}
{{- end }}
{{- end }}

{{/*
Webhook URL path per resource plural. kopf serves each validating handler at "/<handler id>",
so these must equal the handler ids in kvbridge_operator (tests/chart checks that they do).
*/}}
{{- define "kvbridge.webhookPaths" -}}
kvendpoints: /validate-kvendpoint
kvtransfers: /validate-kvtransfer
{{- end }}

{{/*
namespaceSelector of the webhooks: webhook.namespaceSelector if set; else, for a namespaced
operator on Kubernetes >= 1.21 (which labels every namespace with kubernetes.io/metadata.name),
the watched namespaces; else none (every namespace).
*/}}
{{- define "kvbridge.webhookNamespaceSelector" -}}
{{- if .Values.webhook.namespaceSelector }}
namespaceSelector:
  {{- toYaml .Values.webhook.namespaceSelector | nindent 2 }}
{{- else if and (eq .Values.operator.scope "namespaced") (semverCompare ">=1.21-0" .Capabilities.KubeVersion.Version) }}
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: In
      values:
        {{- include "kvbridge.watchNamespaces" . | fromJsonArray | toYaml | nindent 8 }}
{{- end }}
{{- end }}

{{/*
Rules the operator needs inside every namespace it watches (the whole cluster in cluster
scope): the same rules as hack/operator-rbac.yaml, the operator's own list (tests/chart
compares the two), but for the Lease's (kvbridge.leaderElectionRules). KVEndpoints are only
read: the agents own their spec.
*/}}
{{- define "kvbridge.operatorRules" -}}
- apiGroups: ["kvbridge.io"]
  resources: ["kvtransfers"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvbridge.io"]
  resources: ["kvendpoints"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kvbridge.io"]
  resources: ["kvtransfers/status", "kvendpoints/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
The leader election's rules, in the release namespace only: create a Lease (RBAC cannot limit
create to a name), get and update the operator's own.
*/}}
{{- define "kvbridge.leaderElectionRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "kvbridge.leaseName" . | quote }}]
  verbs: ["get", "update"]
{{- end }}

{{/*
Rules on cluster-scoped objects: node labels (TopologyAware pairing), CRDs (kopf notices
resources appearing and disappearing at run time) and namespaces (namespaced kopf only).
*/}}
{{- define "kvbridge.operatorClusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if eq .Values.operator.scope "namespaced" }}
{{- /* A namespaced kopf lists and watches namespaces to match its --namespace patterns;
without it, it retries for about a minute before starting. */}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/* The serving pods' rules: their own KVEndpoint and its handshake status; KVTransfers read-only. */}}
{{- define "kvbridge.agentRules" -}}
- apiGroups: ["kvbridge.io"]
  resources: ["kvendpoints"]
  verbs: ["create", "get", "update", "patch"]
- apiGroups: ["kvbridge.io"]
  resources: ["kvendpoints/status"]
  verbs: ["get", "update", "patch"]
- apiGroups: ["kvbridge.io"]
  resources: ["kvtransfers"]
  verbs: ["get", "list", "watch"]
{{- end }}

{{/* labels: of one alert (severity and prometheusRule.alertLabels), for prometheusrule.yaml. */}}
{{- define "kvbridge.alertLabels" -}}
{{- $labels := merge (dict "severity" .severity) (deepCopy .v.alertLabels) }}
          labels:
            {{- toYaml $labels | nindent 12 }}
{{- end }}

{{/* The runbook_url annotation of one alert, when prometheusRule.runbookUrlBase is set. */}}
{{- define "kvbridge.runbookUrl" -}}
{{- with .v.runbookUrlBase }}
            runbook_url: {{ printf "%s%s" . $.alert | quote }}
{{- end }}
{{- end }}
